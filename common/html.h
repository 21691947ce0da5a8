#ifndef TANDEM_COMMON_HTML_H_
#define TANDEM_COMMON_HTML_H_

#include <string>
#include <string_view>

namespace tandem {

// `text` safe inside HTML text and quoted attributes: & < > " ' become
// entities (&#34; and &#39; for the quotes, as Jinja2's escape writes them).
std::string HtmlEscape(std::string_view text);

}  // namespace tandem

#endif  // TANDEM_COMMON_HTML_H_
