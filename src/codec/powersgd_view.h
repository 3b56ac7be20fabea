// How the powersgd codec cuts a bucket: matrices, each compressed by its own power iteration
// (its own P, Q and warm start), and plain ranges that travel as float32 values.
//
// Two views:
// - fused (no shapes known, or an explicit cols): the whole bucket is one rows x cols matrix
//   (powersgd_matrix.h's make_shape), as plans without shapes always had it;
// - per tensor (the plan gives shapes): every tensor of two or more dimensions is its own
//   n x prod(rest) matrix, as in the paper and PyTorch's hook (a convolution's output channels
//   are the rows), when rank * (rows + cols) is under half of rows * cols; every other tensor
//   (biases, norms, and matrices too thin to gain) is plain, sent as it is.
//
// Payload layout of the two rounds (float32, column-major factors, see powersgd_matrix.h):
//   round 0: P of every matrix, one after another        (p_values in all)
//   round 1: Q of every matrix, then the plain ranges     (q_values + plain_values)
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "codec/powersgd_matrix.h"
#include "gradcomp/codec.h"

namespace gradcomp::powersgd {

// A matrix of the bucket: elements [offset, offset + shape.n), its P at p_at of round 0's
// payload, its Q at q_at of round 1's.
struct Block {
  size_t offset = 0;
  Shape shape;
  size_t p_at = 0;
  size_t q_at = 0;
};

// Elements [offset, offset + n) of the bucket, sent uncompressed.
struct Range {
  size_t offset = 0;
  size_t n = 0;
};

struct View {
  size_t n = 0;
  std::vector<Block> blocks;
  std::vector<Range> plain;
  size_t p_values = 0;      // rank * rows summed over the blocks
  size_t q_values = 0;      // rank * cols summed over the blocks
  size_t plain_values = 0;  // elements of the plain ranges
};

inline void add_block(View& v, size_t offset, const Shape& s) {
  v.blocks.push_back({offset, s, v.p_values, v.q_values});
  v.p_values += s.rank * s.rows;
  v.q_values += s.rank * s.cols;
}

inline void add_plain(View& v, size_t offset, size_t n) {
  if (n == 0) return;
  if (!v.plain.empty() && v.plain.back().offset + v.plain.back().n == offset) {
    v.plain.back().n += n;  // neighbours merge into one range
  } else {
    v.plain.push_back({offset, n});
  }
  v.plain_values += n;
}

// The whole bucket as one matrix.
inline View fused_view(size_t n, size_t cols, size_t rank) {
  View v;
  v.n = n;
  add_block(v, 0, make_shape(n, cols, rank));
  return v;
}

// The matrix of a tensor of `dims` holding `elements`, or rank 0 when it gains nothing.
inline Shape tensor_matrix(const TensorShape& t, size_t rank) {
  Shape s;
  if (t.dims.size() < 2 || t.elements == 0 || t.dims[0] == 0) return s;
  s.n = t.elements;
  s.rows = t.dims[0];
  s.cols = t.elements / s.rows;
  if (s.rows * s.cols != t.elements) return {};  // dims that do not hold `elements`: plain
  s.rank = std::min({rank, s.rows, s.cols});
  const bool gains = 2 * s.rank * (s.rows + s.cols) < s.rows * s.cols;
  if (!gains) s.rank = 0;
  return s;
}

inline View tensor_view(std::span<const TensorShape> tensors, size_t rank) {
  View v;
  for (const TensorShape& t : tensors) {
    const Shape s = tensor_matrix(t, rank);
    if (s.rank > 0) {
      add_block(v, v.n, s);
    } else {
      add_plain(v, v.n, t.elements);
    }
    v.n += t.elements;
  }
  return v;
}

// Whether the tensors' shapes are known: a plan written without shapes keeps the fused view.
inline bool shapes_known(std::span<const TensorShape> tensors) {
  return std::any_of(tensors.begin(), tensors.end(),
                     [](const TensorShape& t) { return !t.dims.empty(); });
}

}  // namespace gradcomp::powersgd
