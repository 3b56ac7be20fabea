// Sparse gradients (nn.Embedding(sparse=True), nn.EmbeddingBag(sparse=True)) exchanged as rows:
// a step that touched a few hundred rows of a large table sends those rows, not the table.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <string>

#include "gradcomp/transport.h"

namespace gradcomp::torch {

struct SparseMean {
  at::Tensor grad;          // coalesced sparse, the parameter's type; the same on every rank
  size_t bytes_sent = 0;    // what this rank handed to the transport
  size_t dense_bytes = 0;   // what a dense exchange of the parameter would hand over (fp32)
  bool finite = true;
};

// The mean over ranks of `grad`, a sparse gradient of `param` whose first dimension indexes
// rows (sparse_dim 1, as embeddings make); undefined when this rank has none (it adds no rows).
// Every rank gets the same coalesced tensor, bit for bit: the union of the ranks' rows, each
// summed in rank order and divided by the world size. A collective: every rank calls it for
// the same parameters in the same order. The rows travel by one of two schemes, whichever
// hands over fewer bytes:
//   - allgather: every rank receives every rank's rows (sum over ranks of their rows);
//   - union: the union of the rows is cut into one block per rank, each rank sums its block
//     over ranks (alltoallv) and the sums are allgathered (2 (W-1)/W of the union), which is
//     the dense allreduce restricted to the rows someone touched.
// Throws Error naming the parameter when the gradient is not such a sparse tensor, CommError
// when a rank sends a row outside the table.
SparseMean sparse_rows_mean(Transport& transport, const std::string& name,
                            const at::Tensor& param, const at::Tensor& grad);

}  // namespace gradcomp::torch
