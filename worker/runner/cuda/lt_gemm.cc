#include "worker/runner/cuda/lt_gemm.h"

#include <cublasLt.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::worker {

// The entry points tandem calls, resolved from the loaded library.
struct LtGemm::Api {
  void* lib = nullptr;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtGetStatusString) status_string = nullptr;

  ~Api() {
    if (lib != nullptr) dlclose(lib);
  }
  std::string Error(cublasStatus_t s) const {
    return status_string != nullptr ? status_string(s) : absl::StrCat("cublasStatus ", static_cast<int>(s));
  }
};

// One shape's descriptors and algorithm.
struct LtGemm::Plan {
  const Api* api = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a != nullptr) api->layout_destroy(a);
    if (b != nullptr) api->layout_destroy(b);
    if (c != nullptr) api->layout_destroy(c);
    if (desc != nullptr) api->desc_destroy(desc);
  }
};

namespace {

template <typename F>
bool Resolve(void* lib, const char* name, F* f) {
  *f = reinterpret_cast<F>(dlsym(lib, name));
  return *f != nullptr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LtGemm>> LtGemm::Create(void* workspace, int64_t workspace_bytes, bool single_pass) {
  auto api = std::make_unique<Api>();
  const char* env = std::getenv("TANDEM_CUBLASLT");
  const std::string path = env != nullptr && *env != '\0' ? env : "libcublasLt.so.13";
  api->lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (api->lib == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("the cuda runner needs cuBLASLt: cannot load ", path, " (", why != nullptr ? why : "unknown error",
                     "); put its directory on LD_LIBRARY_PATH or set TANDEM_CUBLASLT to the library's path"));
  }
  bool ok = Resolve(api->lib, "cublasLtCreate", &api->create) && Resolve(api->lib, "cublasLtDestroy", &api->destroy) &&
            Resolve(api->lib, "cublasLtMatmulDescCreate", &api->desc_create) &&
            Resolve(api->lib, "cublasLtMatmulDescSetAttribute", &api->desc_set) &&
            Resolve(api->lib, "cublasLtMatmulDescDestroy", &api->desc_destroy) &&
            Resolve(api->lib, "cublasLtMatrixLayoutCreate", &api->layout_create) &&
            Resolve(api->lib, "cublasLtMatrixLayoutDestroy", &api->layout_destroy) &&
            Resolve(api->lib, "cublasLtMatmulPreferenceCreate", &api->pref_create) &&
            Resolve(api->lib, "cublasLtMatmulPreferenceSetAttribute", &api->pref_set) &&
            Resolve(api->lib, "cublasLtMatmulPreferenceDestroy", &api->pref_destroy) &&
            Resolve(api->lib, "cublasLtMatmulAlgoGetHeuristic", &api->heuristic) &&
            Resolve(api->lib, "cublasLtMatmul", &api->matmul);
  Resolve(api->lib, "cublasLtGetStatusString", &api->status_string);  // optional
  if (!ok) {
    return absl::FailedPreconditionError(absl::StrCat(path, " lacks a cuBLASLt entry point tandem needs (", dlerror(),
                                                      "): a cuBLAS 13 library is required"));
  }
  cublasLtHandle_t handle = nullptr;
  if (cublasStatus_t s = api->create(&handle); s != CUBLAS_STATUS_SUCCESS) {
    return absl::FailedPreconditionError(absl::StrCat("cublasLtCreate: ", api->Error(s)));
  }
  return std::unique_ptr<LtGemm>(new LtGemm(std::move(api), handle, workspace, workspace_bytes, single_pass));
}

LtGemm::LtGemm(std::unique_ptr<Api> api, void* handle, void* workspace, int64_t workspace_bytes, bool single_pass)
    : api_(std::move(api)),
      handle_(handle),
      workspace_(workspace),
      workspace_bytes_(workspace_bytes),
      single_pass_(single_pass) {}

LtGemm::~LtGemm() {
  plans_.clear();
  api_->destroy(static_cast<cublasLtHandle_t>(handle_));
}

absl::StatusOr<const LtGemm::Plan*> LtGemm::PlanFor(const Key& key) {
  if (auto it = plans_.find(key); it != plans_.end()) return it->second.get();
  const auto [m, n, k, out] = key;
  auto plan = std::make_unique<Plan>();
  plan->api = api_.get();
  const Api& api = *api_;
  auto check = [&](cublasStatus_t s, const char* what) {
    return s == CUBLAS_STATUS_SUCCESS
               ? absl::OkStatus()
               : absl::InternalError(absl::StrFormat("%s for a %dx%dx%d product: %s", what, m, n, k, api.Error(s)));
  };
  // Column-major view: Y^T[n, m] = W[k, n]^T . X^T[k, m].
  const cudaDataType_t out_type = out == Out::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  if (absl::Status s = check(api.desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
      !s.ok()) {
    return s;
  }
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  if (absl::Status s = check(api.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)), "TRANSA");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = check(api.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)), "TRANSB");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = check(api.layout_create(&plan->a, CUDA_R_16BF, k, n, k), "layout of W"); !s.ok()) return s;
  if (absl::Status s = check(api.layout_create(&plan->b, CUDA_R_16BF, k, m, k), "layout of X"); !s.ok()) return s;
  if (absl::Status s = check(api.layout_create(&plan->c, out_type, n, m, n), "layout of Y"); !s.ok()) return s;
  cublasLtMatmulPreference_t pref = nullptr;
  if (absl::Status s = check(api.pref_create(&pref), "cublasLtMatmulPreferenceCreate"); !s.ok()) return s;
  const uint64_t ws = static_cast<uint64_t>(workspace_bytes_);
  if (absl::Status s = check(api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
                             "the workspace preference");
      !s.ok()) {
    api.pref_destroy(pref);
    return s;
  }
  if (single_pass_) {
    // Only algorithms that reduce each dot product in one sequence (no
    // split-K partial sums): a row's result then does not depend on how many
    // rows the product has.
    const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
    if (absl::Status s =
            check(api.pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction, sizeof(reduction)),
                  "the single-pass preference");
        !s.ok()) {
      api.pref_destroy(pref);
      return s;  // never silently without the batch invariance asked for
    }
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t hs = api.heuristic(static_cast<cublasLtHandle_t>(handle_), plan->desc, plan->a, plan->b, plan->c,
                                          plan->c, pref, 1, &result, &found);
  api.pref_destroy(pref);
  if (absl::Status s = check(hs, "cublasLtMatmulAlgoGetHeuristic"); !s.ok()) return s;
  if (found == 0) {
    return absl::InternalError(absl::StrFormat("cuBLASLt has no algorithm for a %dx%dx%d bf16 product", m, n, k));
  }
  plan->algo = result.algo;
  const Plan* p = plan.get();
  plans_.emplace(key, std::move(plan));
  return p;
}

absl::Status LtGemm::Gemm(const void* x, int m, int k, const void* w, int n, float beta, void* y, Out out,
                          void* stream) {
  if (m == 0 || n == 0) return absl::OkStatus();
  absl::StatusOr<const Plan*> plan = PlanFor(Key{m, n, k, out});
  if (!plan.ok()) return plan.status();
  const float alpha = 1.0f;
  const cublasStatus_t s = api_->matmul(static_cast<cublasLtHandle_t>(handle_), (*plan)->desc, &alpha, w, (*plan)->a, x,
                                        (*plan)->b, &beta, y, (*plan)->c, y, (*plan)->c, &(*plan)->algo, workspace_,
                                        static_cast<size_t>(workspace_bytes_), static_cast<cudaStream_t>(stream));
  if (s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrFormat("cublasLtMatmul (%dx%dx%d): %s", m, n, k, api_->Error(s)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> LtGemm::Preload(const void* x, int max_m, int k, const void* w, int n, void* y, Out out,
                                    void* stream) {
  std::set<std::string> seen;  // the algorithms' bytes
  for (int m = 1; m <= max_m; ++m) {
    absl::StatusOr<const Plan*> plan = PlanFor(Key{m, n, k, out});
    if (!plan.ok()) return plan.status();
    std::string bytes(sizeof((*plan)->algo), '\0');
    std::memcpy(bytes.data(), &(*plan)->algo, bytes.size());
    if (!seen.insert(std::move(bytes)).second) continue;
    if (absl::Status s = Gemm(x, m, k, w, n, 0.0f, y, out, stream); !s.ok()) return s;
  }
  return static_cast<int>(seen.size());
}

}  // namespace tandem::worker
