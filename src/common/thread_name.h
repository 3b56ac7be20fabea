// Names the calling thread ("gc-encoder"), so a debugger, top -H or a profiler tells gradcomp's
// threads apart. Linux keeps 15 characters.
#pragma once

#include <pthread.h>

#include <string>

namespace gradcomp {

inline void name_this_thread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace gradcomp
