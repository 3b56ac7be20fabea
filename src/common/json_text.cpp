#include "gradcomp/json_text.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace gradcomp {

nlohmann::json parse_json_text(std::string_view text, std::string_view where) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    // A syntax error (parse_error) or a number too large for a double ("1e999": out_of_range).
    // nlohmann's message starts with its own id ("[json.exception.parse_error.101] "), which
    // means nothing to a user; the rest says the line, column and what was expected.
    std::string_view message = e.what();
    if (const size_t id_end = message.find("] "); message.starts_with("[json.") &&
                                                  id_end != std::string_view::npos) {
      message.remove_prefix(id_end + 2);
    }
    throw Error(fmt::format("{}: not valid JSON: {}", where, message));
  }
}

nlohmann::json read_json_file(const std::string& path, std::string_view what) {
  const std::string where = fmt::format("{} '{}'", what, path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot open {}: {}", where, std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  return parse_json_text(text.str(), where);
}

}  // namespace gradcomp
