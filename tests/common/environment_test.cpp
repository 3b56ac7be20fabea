// env_text and env_int: unset and empty mean "not set"; a whole number in range is read; anything
// else is an error naming the variable, its value and the range.
#include "common/environment.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "gradcomp/error.h"

namespace gradcomp {
namespace {

constexpr const char* kName = "GRADCOMP_ENVIRONMENT_TEST";

std::string environment_error_of(const char* value) {
  setenv(kName, value, 1);
  try {
    env_int(kName, 1, 16, "things at once");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Environment, UnsetAndEmptyAreNotSet) {
  unsetenv(kName);
  EXPECT_FALSE(env_text(kName).has_value());
  EXPECT_FALSE(env_int(kName, 0, 1, "x").has_value());
  setenv(kName, "", 1);
  EXPECT_FALSE(env_text(kName).has_value());
  EXPECT_FALSE(env_int(kName, 0, 1, "x").has_value());
  unsetenv(kName);
}

TEST(Environment, ReadsAWholeNumberInRange) {
  setenv(kName, "path/x", 1);
  EXPECT_EQ(env_text(kName), "path/x");
  for (const long n : {1L, 7L, 16L}) {
    setenv(kName, std::to_string(n).c_str(), 1);
    EXPECT_EQ(env_int(kName, 1, 16, "things at once"), n);
  }
  unsetenv(kName);
}

TEST(Environment, AnythingElseIsAnErrorThatSaysWhatIsAllowed) {
  for (const char* bad : {"0", "17", "-3", "two", "2x", "3.5", " 4", "99999999999999999999999"}) {
    EXPECT_EQ(environment_error_of(bad),
              std::string("environment variable GRADCOMP_ENVIRONMENT_TEST='") + bad +
                  "' must be a whole number from 1 to 16 (things at once)");
  }
  unsetenv(kName);
}

}  // namespace
}  // namespace gradcomp
