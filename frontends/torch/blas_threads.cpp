#include "gradcomp/torch/blas_threads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <fstream>
#include <mutex>
#include <set>

namespace gradcomp::torch {

std::optional<int> openblas_threads() {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> paths;
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.find('/');
    if (slash != std::string::npos && line.find("libopenblas", slash) != std::string::npos) {
      paths.insert(line.substr(slash));
    }
  }
  for (const auto& path : paths) {
    // Already loaded: RTLD_NOLOAD only takes another reference to it.
    void* library = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
    if (library == nullptr) continue;
    using Get = int (*)();
    const auto get = reinterpret_cast<Get>(dlsym(library, "openblas_get_num_threads"));
    const std::optional<int> threads = get ? std::optional<int>(get()) : std::nullopt;
    dlclose(library);
    if (threads) return threads;
  }
  return std::nullopt;
}

std::string blas_threads_warning(std::optional<int> blas, int torch_threads) {
  if (!blas || *blas <= torch_threads) return {};
  return fmt::format(
      "gradcomp: torch uses {} thread(s) but OpenBLAS runs {}, which spin between matrix "
      "products and take the cores the exchange (and other ranks on this machine) need; start "
      "the ranks with OMP_NUM_THREADS={} (gradcomp launch and torchrun set 1 for several ranks; "
      "under mpirun, -x OMP_NUM_THREADS={})",
      torch_threads, *blas, torch_threads, torch_threads);
}

std::string take_blas_threads_warning() {
  static std::once_flag once;
  std::string warning;
  std::call_once(once, [&warning] {
    warning = blas_threads_warning(openblas_threads(), at::get_num_threads());
  });
  return warning;
}

void warn_if_blas_outnumbers_torch() {
  const std::string warning = take_blas_threads_warning();
  if (!warning.empty()) TORCH_WARN(warning);
}

}  // namespace gradcomp::torch
