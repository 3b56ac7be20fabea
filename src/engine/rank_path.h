// Where each rank writes its own copy of a file the user names once (the timeline).
#pragma once

#include <string>

namespace gradcomp {

// The timeline file of `rank`: "{rank}" in `path` is replaced by the rank; without it,
// ".rank<R>" goes before the extension ("trace.json" -> "trace.rank3.json").
std::string rank_path(const std::string& path, int rank);

}  // namespace gradcomp
