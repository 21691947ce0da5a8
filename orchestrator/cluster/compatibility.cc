#include "orchestrator/cluster/compatibility.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tandem::router {
namespace {

std::string Short(const std::string& sha256) { return sha256.substr(0, 12); }

}  // namespace

std::string Incompatibility(const tandem::v1::ModelInfo& worker, const tandem::v1::ModelInfo* reference,
                            const RouterTokenizer& tokenizer) {
  std::vector<std::string> why;
  if (!tokenizer.sha256.empty() && !worker.tokenizer_sha256().empty() &&
      worker.tokenizer_sha256() != tokenizer.sha256) {
    why.push_back(absl::StrCat("its model's tokenizer.json (sha256 ", Short(worker.tokenizer_sha256()),
                               ") is not the router's (", tokenizer.source, ", sha256 ", Short(tokenizer.sha256),
                               "): point the router's model.tokenizer at the checkpoint"));
  } else if (tokenizer.vocab_size > worker.vocab_size()) {
    why.push_back(absl::StrCat("the router's tokenizer (", tokenizer.source, ") has ", tokenizer.vocab_size,
                               " ids, the model's vocabulary only ", worker.vocab_size()));
  }
  if (reference != nullptr) {
    auto differ = [&why](const char* what, const auto& mine, const auto& theirs) {
      if (mine != theirs) why.push_back(absl::StrCat(what, " ", mine, ", the cluster's ", theirs));
    };
    differ("model", worker.model(), reference->model());
    differ("architecture", worker.architecture(), reference->architecture());
    differ("vocab_size", worker.vocab_size(), reference->vocab_size());
    differ("num_layers", worker.num_layers(), reference->num_layers());
    differ("num_kv_heads", worker.num_kv_heads(), reference->num_kv_heads());
    differ("head_dim", worker.head_dim(), reference->head_dim());
    differ("kv_dtype", worker.kv_dtype(), reference->kv_dtype());
    differ("block_size", worker.block_size(), reference->block_size());
    differ("block_hash_seed", worker.block_hash_seed(), reference->block_hash_seed());
    differ("engine", worker.engine(), reference->engine());
    if (!worker.tokenizer_sha256().empty() && !reference->tokenizer_sha256().empty()) {
      differ("tokenizer sha256", Short(worker.tokenizer_sha256()), Short(reference->tokenizer_sha256()));
    }
  }
  return absl::StrJoin(why, "; ");
}

}  // namespace tandem::router
