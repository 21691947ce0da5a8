# Third-party dependencies, all from Debian 12 packages (scripts/install_deps.sh).
find_package(Threads REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(Protobuf REQUIRED)          # module mode, as measured on Debian 12
find_package(gRPC CONFIG REQUIRED)
find_package(OpenSSL REQUIRED)         # mutual TLS certificates (common/certificates.h)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
# SHA-256 of API keys (common/sha256.h).
find_package(OpenSSL REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
find_package(OpenMP REQUIRED)
if(TANDEM_BUILD_TESTS)
  find_package(GTest CONFIG REQUIRED)
  include(GoogleTest)
  find_package(benchmark CONFIG REQUIRED)
endif()
find_program(TANDEM_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
if(TANDEM_WITH_UCX)
  pkg_check_modules(UCX IMPORTED_TARGET ucx)
  if(NOT UCX_FOUND)
    message(STATUS "UCX not found: the UCX KV-transfer backend is off")
    set(TANDEM_WITH_UCX OFF)
  endif()
endif()
# The reference Python (numpy) used by the model-correctness test. Debian's
# interpreter first: a pyenv shim on PATH may lack numpy.
find_program(TANDEM_PYTHON NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(NOT TANDEM_PYTHON)
  find_program(TANDEM_PYTHON python3)
endif()
# The router's YAML config (orchestrator/config).
find_package(yaml-cpp CONFIG REQUIRED)
# The router's tokenizer (orchestrator/tokenizer): PCRE2 for pre-tokenizer
# regexes, ICU for Unicode normalization.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
pkg_check_modules(ICU_UC REQUIRED IMPORTED_TARGET icu-uc)

# Boost.Beast/Asio (header-only): the router's HTTP server and the tests' client.
find_package(Boost 1.74 REQUIRED)
