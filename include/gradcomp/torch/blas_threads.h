// The threads of the BLAS under torch. Debian's libtorch multiplies in OpenBLAS (its pthreads
// build), whose threads at::set_num_threads does not reach: between matrix products they spin
// on sched_yield and take the cores the exchange, and other ranks on the machine, need.
// OMP_NUM_THREADS sets them (gradcomp launch and torchrun give 1 to each of several ranks).
#pragma once

#include <optional>
#include <string>

namespace gradcomp::torch {

// The threads of the OpenBLAS loaded in this process; nullopt for another BLAS or none.
std::optional<int> openblas_threads();

// What to tell a user whose BLAS runs `blas` threads where torch runs `torch_threads`; empty
// when it runs no more (or is not OpenBLAS).
std::string blas_threads_warning(std::optional<int> blas, int torch_threads);

// That warning at the first call of this process, empty at every later one: said once per
// process, by whichever front end asks first (Python shows it as a Python warning; its
// optimizers' C++ parts then find it taken).
std::string take_blas_threads_warning();

// TORCH_WARNs take_blas_threads_warning() (the libtorch front end's first optimizer).
void warn_if_blas_outnumbers_torch();

}  // namespace gradcomp::torch
