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

// A collective that failed: a peer closed its connection, a transport reported an error, or
// the ranks disagree (registered tensors, plan). The message names the bucket and phase.
class CommError : public Error {
 public:
  using Error::Error;
};

// A collective that did not finish within its timeout (GRADCOMP_TIMEOUT, default 300 s): a peer
// died or stopped. The message names the bucket and phase.
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

}  // namespace gradcomp
