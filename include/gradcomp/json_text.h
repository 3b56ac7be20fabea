// Reading the JSON documents people and programs hand to gradcomp (plans, profiles, clusters,
// codec costs). Every error says where the document came from ("plan file 'p.json'", "plan"),
// and a syntax error says where in the text it is, so a user can find the mistake without
// knowing which library parsed it.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "gradcomp/error.h"

namespace gradcomp {

// Parses `text`. Bad syntax is an Error "<where>: not valid JSON: parse error at line L,
// column C: <what>".
nlohmann::json parse_json_text(std::string_view text, std::string_view where);

// Reads and parses the file at `path`; `what` names the document ("plan file") and every error
// starts with "<what> '<path>'": one that cannot be opened (with the system's reason) or bad
// syntax (as parse_json_text).
nlohmann::json read_json_file(const std::string& path, std::string_view what);

// Runs `read` and puts "<where>: " in front of the message of any Error it throws, keeping a
// SpecError a SpecError, so a field path ("buckets[1].codec: ...") also says whose field it is.
template <class F>
auto with_context(std::string_view where, F&& read) -> decltype(read()) {
  try {
    return read();
  } catch (const SpecError& e) {
    throw SpecError(std::string(where) + ": " + e.what());
  } catch (const Error& e) {
    throw Error(std::string(where) + ": " + e.what());
  }
}

}  // namespace gradcomp
