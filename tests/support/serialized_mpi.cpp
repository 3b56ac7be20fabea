// Linked into the *_serialized_mptest programs (tests/CMakeLists.txt): each runs a
// multi-process suite again with MPI initialised by the program, before gradcomp's first
// transport, at MPI_THREAD_SERIALIZED, as an application whose MPI gives no more would.
// gradcomp then holds its process-wide MPI lock around every MPI call and splits one
// communicator at a time (src/transport/mpi_runtime.h): paths that Debian's Open MPI, which
// gives MPI_THREAD_MULTIPLE to gradcomp's own start, never takes otherwise.
#include <gtest/gtest.h>

#include "transport/mpi_runtime.h"

namespace {

// Before main(), hence before the world transport: MPI is the application's from the start.
struct SerializedMpi {
  SerializedMpi() {
    int provided = MPI_THREAD_SINGLE;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
  }
  // The application's MPI is the application's to finalise (gradcomp finalises only an MPI it
  // started), after main(), when every transport is gone. The barriers of the test of failing
  // splits (transport/serialized_splits.cpp) are still pending then, each on a communicator of
  // its own: Open MPI finalises without them (mpirun fails a rank that exits without it).
  ~SerializedMpi() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
};
const SerializedMpi g_serialized_mpi;

TEST(SerializedMpi, MpiRunsAtSerializedAndGradcompHoldsItsLock) {
  int provided = MPI_THREAD_MULTIPLE;
  MPI_Query_thread(&provided);
  // Were it MULTIPLE, the suite beside this test would not test the locked path at all.
  ASSERT_EQ(provided, MPI_THREAD_SERIALIZED);
  EXPECT_TRUE(gradcomp::mpi::serialized());
  EXPECT_TRUE(gradcomp::mpi::lock().owns_lock());
}

}  // namespace
