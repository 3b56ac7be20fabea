// Settings read from the environment (GRADCOMP_STREAMS, RANK, ...): one reading rule and one
// wording of the error for every variable.
#pragma once

#include <optional>
#include <string>

namespace gradcomp {

// The variable's text, or nullopt when it is unset or empty (an empty value means "not set",
// as `VAR= cmd` is how a user clears one for one command).
std::optional<std::string> env_text(const char* name);

// A whole number in [min, max], or nullopt when unset or empty. Anything else (text, a
// fraction, out of range) is an Error naming the variable, its value and what is allowed;
// `meaning` (e.g. "buckets exchanged at once") says what the number is for.
std::optional<long> env_int(const char* name, long min, long max, const char* meaning);

}  // namespace gradcomp
