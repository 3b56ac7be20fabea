// Errors raised by gradcomp. Every message says what was wrong and what is allowed.
#pragma once

#include <stdexcept>
#include <string>

namespace gradcomp {

// Base of every error gradcomp throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A codec or feedback spec string that cannot be honoured (unknown name, bad parameter).
class SpecError : public Error {
 public:
  using Error::Error;
};

// A frame that cannot be decoded: truncated, corrupted, from another codec or version.
class FrameError : public Error {
 public:
  using Error::Error;
};

}  // namespace gradcomp
