// The per-thread record of the last argument error (contract: common.cuh).
#include <string>
#include <utility>

#include "common.cuh"

namespace hicache {

namespace {
// Per thread: the Python bindings release the GIL around calls, so several threads may call in.
thread_local std::string last_argument_error;
}  // namespace

void clear_argument_error() { last_argument_error.clear(); }

const char* argument_error() { return last_argument_error.c_str(); }

cudaError_t set_argument_error(std::string message) {
  last_argument_error = std::move(message);
  return cudaErrorInvalidValue;
}

}  // namespace hicache
