// A duration as the transports' errors show it, in seconds to three digits ("after 60 s").
#pragma once

#include <fmt/format.h>

#include <string>

#include "gradcomp/transport.h"

namespace gradcomp {

inline std::string seconds_text(Milliseconds t) {
  return fmt::format("{:.3g}", t.count() / 1000.0);
}

}  // namespace gradcomp
