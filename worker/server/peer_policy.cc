#include "worker/server/peer_policy.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tandem::worker {
namespace {

std::array<uint8_t, 16> Mapped(const in_addr& v4) {
  std::array<uint8_t, 16> out{};
  out[10] = 0xff;
  out[11] = 0xff;
  std::memcpy(out.data() + 12, &v4, 4);
  return out;
}

// An IPv4 or IPv6 literal (no brackets) as 16 bytes; false if neither.
bool ParseIp(const std::string& text, std::array<uint8_t, 16>* out, bool* v4) {
  in_addr a4;
  if (inet_pton(AF_INET, text.c_str(), &a4) == 1) {
    *out = Mapped(a4);
    *v4 = true;
    return true;
  }
  in6_addr a6;
  if (inet_pton(AF_INET6, text.c_str(), &a6) == 1) {
    std::memcpy(out->data(), &a6, 16);
    *v4 = false;
    return true;
  }
  return false;
}

// RFC 1123 host name: labels of letters, digits and '-', not starting or
// ending with '-', up to 63 characters each, 253 in all.
bool IsDnsName(absl::string_view host) {
  if (host.empty() || host.size() > 253) return false;
  for (absl::string_view label : absl::StrSplit(host, '.')) {
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char c : label) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-') return false;
    }
  }
  return true;
}

std::string IpText(const std::array<uint8_t, 16>& ip) {
  char buf[INET6_ADDRSTRLEN] = {};
  static const uint8_t kMappedPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(ip.data(), kMappedPrefix, 12) == 0) {
    inet_ntop(AF_INET, ip.data() + 12, buf, sizeof buf);
  } else {
    inet_ntop(AF_INET6, ip.data(), buf, sizeof buf);
  }
  return buf;
}

bool IsMapped(const std::array<uint8_t, 16>& ip) {
  static const uint8_t kMappedPrefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return std::memcmp(ip.data(), kMappedPrefix, 12) == 0;
}

}  // namespace

absl::StatusOr<PeerAddress> ParsePeerAddress(absl::string_view text, absl::string_view field) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " '", text.substr(0, 200), "' is not a plain host:port: ", why));
  };
  if (text.size() > 300) return bad("too long");
  PeerAddress out;
  absl::string_view host, port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == absl::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return bad("a bracketed IPv6 address must be followed by :port");
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
    bool v4 = false;
    if (!ParseIp(std::string(host), &out.ip, &v4) || v4) return bad("not an IPv6 address in brackets");
    out.literal = true;
  } else {
    const size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) return bad("no :port");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != absl::string_view::npos) {
      return bad("a URI, a gRPC target scheme or an unbracketed IPv6 address");
    }
    bool v4 = false;
    if (ParseIp(std::string(host), &out.ip, &v4)) {
      out.literal = true;
    } else if (!IsDnsName(host)) {
      return bad("the host is neither an IP address nor a DNS name");
    }
  }
  int p = 0;
  const bool digits = !port.empty() && port.size() <= 5 && std::all_of(port.begin(), port.end(), [](char c) {
    return absl::ascii_isdigit(static_cast<unsigned char>(c));
  });
  if (!digits || !absl::SimpleAtoi(port, &p) || p < 1 || p > 65535) {
    return bad("the port must be a number in 1..65535");
  }
  out.host = std::string(host);
  out.port = p;
  return out;
}

PeerAllowList PeerAllowList::Loopback() {
  absl::StatusOr<PeerAllowList> l = Parse("127.0.0.0/8,::1/128", "loopback");
  return *l;
}

absl::StatusOr<PeerAllowList> PeerAllowList::Parse(absl::string_view text, absl::string_view flag) {
  PeerAllowList list;
  if (absl::StripAsciiWhitespace(text) == "any") return list;
  list.any_ = false;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", item, "' is not a CIDR block (", why, ")"));
    };
    absl::string_view addr = item;
    int prefix = -1;
    if (const size_t slash = item.find('/'); slash != absl::string_view::npos) {
      addr = item.substr(0, slash);
      if (!absl::SimpleAtoi(item.substr(slash + 1), &prefix)) return bad("bad prefix length");
    }
    Block b;
    bool v4 = false;
    if (!ParseIp(std::string(addr), &b.net, &v4)) return bad("not an IP address");
    const int max = v4 ? 32 : 128;
    if (prefix < 0) prefix = max;
    if (prefix > max) return bad(absl::StrCat("prefix over ", max));
    b.prefix = v4 ? prefix + 96 : prefix;
    // Clear the host bits.
    for (int bit = b.prefix; bit < 128; ++bit) b.net[bit / 8] &= ~(0x80 >> (bit % 8));
    list.blocks_.push_back(b);
  }
  if (list.blocks_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": empty (give CIDR blocks or 'any')"));
  }
  return list;
}

bool PeerAllowList::Allows(const std::array<uint8_t, 16>& ip) const {
  if (any_) return true;
  for (const Block& b : blocks_) {
    bool match = true;
    for (int bit = 0; bit < b.prefix && match; ++bit) {
      const uint8_t mask = 0x80 >> (bit % 8);
      match = (ip[bit / 8] & mask) == (b.net[bit / 8] & mask);
    }
    if (match) return true;
  }
  return false;
}

std::string PeerAllowList::ToString() const {
  if (any_) return "any";
  std::string out;
  for (const Block& b : blocks_) {
    const bool v4 = IsMapped(b.net) && b.prefix >= 96;
    absl::StrAppend(&out, out.empty() ? "" : ",", IpText(b.net), "/", v4 ? b.prefix - 96 : b.prefix);
  }
  return out;
}

absl::StatusOr<std::string> PeerAllowList::CheckedTarget(const PeerAddress& address) const {
  if (any_) {
    return address.literal && !IsMapped(address.ip) ? absl::StrCat("[", address.host, "]:", address.port)
                                                    : absl::StrCat(address.host, ":", address.port);
  }
  std::vector<std::array<uint8_t, 16>> ips;
  if (address.literal) {
    ips.push_back(address.ip);
  } else {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = getaddrinfo(address.host.c_str(), nullptr, &hints, &res);
    if (rc != 0) {
      return absl::UnavailableError(absl::StrCat("cannot resolve ", address.host, ": ", gai_strerror(rc)));
    }
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      std::array<uint8_t, 16> ip{};
      if (a->ai_family == AF_INET) {
        ip = Mapped(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr);
      } else if (a->ai_family == AF_INET6) {
        std::memcpy(ip.data(), &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, 16);
      } else {
        continue;
      }
      ips.push_back(ip);
    }
    freeaddrinfo(res);
    if (ips.empty()) return absl::UnavailableError(absl::StrCat(address.host, " has no address"));
  }
  for (const auto& ip : ips) {
    if (!Allows(ip)) {
      return absl::PermissionDeniedError(absl::StrCat("decode_address ", address.host, ":", address.port, " (",
                                                      IpText(ip), ") is outside this worker's --kv-peer-allow (",
                                                      ToString(), ")"));
    }
  }
  const auto& ip = ips.front();
  return IsMapped(ip) ? absl::StrCat("ipv4:", IpText(ip), ":", address.port)
                      : absl::StrCat("ipv6:[", IpText(ip), "]:", address.port);
}

}  // namespace tandem::worker
