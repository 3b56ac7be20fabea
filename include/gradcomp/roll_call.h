// The roll call: after a collective failed, which peers are gone?
//
// A transport's error names at most a socket address, and a timeout names nothing. But a
// failed collective fails on every survivor (each closes its connections at once, or times out
// alike), so after a failure every live rank signs a board every rank can read (the rendezvous
// store); the ranks that have not signed within a short grace period are the ones that died,
// stopped, or no longer exchange. The answer goes into the error message.
#pragma once

#include <memory>
#include <string>

#include "gradcomp/transport.h"

namespace gradcomp {

// A board every rank of the failed communicator can write and read, such as a key-value store
// under a prefix of the communicator's own.
class Attendance {
 public:
  virtual ~Attendance() = default;
  virtual void sign(int rank) = 0;        // `rank` is alive and saw the failure
  virtual bool signed_by(int rank) = 0;   // whether `rank` signed, now (no waiting)
  virtual std::string where() const = 0;  // the board, for messages
};

// Signs for `rank`, waits up to `grace` for the other ranks of `size`, and returns a clause for
// the error message: which ranks did not answer, or that every peer did. Returns within about
// twice `grace` even when the board itself does not answer (its server may be the rank that
// stopped); the board is then named as unreachable.
std::string roll_call(std::shared_ptr<Attendance> board, int rank, int size, Milliseconds grace);

// The grace period for a transport of this timeout: half of it, within 0.2 .. 2 s.
Milliseconds roll_call_grace(Milliseconds timeout);

}  // namespace gradcomp
