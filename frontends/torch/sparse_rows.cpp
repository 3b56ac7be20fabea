#include "gradcomp/torch/sparse_rows.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <span>
#include <vector>

#include "gradcomp/error.h"

namespace gradcomp::torch {
namespace {

// This rank's rows: ascending unique row numbers and their float32 values (row_len each).
struct Rows {
  std::vector<int64_t> index;
  std::vector<float> values;
};

Rows local_rows(const std::string& name, const at::Tensor& param, const at::Tensor& grad,
                size_t row_len) {
  Rows rows;
  if (!grad.defined()) return rows;
  if (!grad.is_sparse() || grad.sparse_dim() != 1 || grad.sizes() != param.sizes()) {
    throw Error(fmt::format(
        "gradcomp: parameter '{}' is exchanged as sparse rows, but its gradient is {} with "
        "sparse_dim {} and shape [{}] (expected a sparse tensor of shape [{}] indexed by its "
        "first dimension, as nn.Embedding(sparse=True) makes)",
        name, grad.is_sparse() ? "sparse" : "dense", grad.is_sparse() ? grad.sparse_dim() : 0,
        fmt::join(grad.sizes(), ", "), fmt::join(param.sizes(), ", ")));
  }
  const at::Tensor g = grad.coalesce();
  const at::Tensor index = g.indices()[0].contiguous();
  const at::Tensor values = g.values().to(at::kFloat).contiguous();
  const auto m = static_cast<size_t>(index.numel());
  rows.index.assign(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + m);
  rows.values.assign(values.data_ptr<float>(), values.data_ptr<float>() + m * row_len);
  return rows;
}

template <class T>
std::span<const std::byte> bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span(v));
}
template <class T>
std::span<std::byte> bytes_of(std::vector<T>& v) {
  return std::as_writable_bytes(std::span(v));
}

// Runs one collective to completion, its errors saying what was being exchanged.
template <class Start>
void run(Transport& t, const std::string& name, const char* what, Start start) {
  try {
    start()->wait(t.timeout());
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("gradcomp: sparse rows of '{}' ({}): {}", name, what, e.what()));
  } catch (const CommError& e) {
    throw CommError(fmt::format("gradcomp: sparse rows of '{}' ({}): {}", name, what, e.what()));
  }
}

// Every rank's row count and rows, concatenated in rank order.
struct AllIndex {
  std::vector<uint64_t> counts;
  std::vector<int64_t> index;
};

AllIndex gather_index(Transport& t, const std::string& name, const Rows& mine) {
  AllIndex all;
  const uint64_t m = mine.index.size();
  all.counts.resize(static_cast<size_t>(t.size()));
  run(t, name, "row counts", [&] {
    return t.allgather(std::as_bytes(std::span(&m, 1)), bytes_of(all.counts));
  });
  std::vector<size_t> byte_counts;
  for (uint64_t c : all.counts) byte_counts.push_back(c * sizeof(int64_t));
  all.index.resize(std::accumulate(all.counts.begin(), all.counts.end(), size_t{0}));
  run(t, name, "row numbers",
      [&] { return t.allgatherv(bytes_of(mine.index), bytes_of(all.index), byte_counts); });
  return all;
}

std::vector<int64_t> union_of(const std::string& name, std::vector<int64_t> index,
                              int64_t table_rows) {
  std::sort(index.begin(), index.end());
  index.erase(std::unique(index.begin(), index.end()), index.end());
  if (!index.empty() && (index.front() < 0 || index.back() >= table_rows)) {
    throw CommError(fmt::format(
        "gradcomp: sparse rows of '{}': a rank sent row {}, outside the table's {} rows (the "
        "ranks' models differ)",
        name, index.front() < 0 ? index.front() : index.back(), table_rows));
  }
  return index;
}

size_t position(const std::vector<int64_t>& rows, int64_t row) {
  return static_cast<size_t>(std::lower_bound(rows.begin(), rows.end(), row) - rows.begin());
}

void add_row(float* into, const float* row, size_t row_len) {
  for (size_t j = 0; j < row_len; ++j) into[j] += row[j];
}

// Allgather scheme: every rank's values, summed here in rank order.
std::vector<float> sum_by_allgather(Transport& t, const std::string& name, const Rows& mine,
                                    const AllIndex& all, const std::vector<int64_t>& rows,
                                    size_t row_len, size_t& bytes_sent) {
  std::vector<size_t> byte_counts;
  for (uint64_t c : all.counts) byte_counts.push_back(c * row_len * sizeof(float));
  std::vector<float> values(all.index.size() * row_len);
  run(t, name, "values",
      [&] { return t.allgatherv(bytes_of(mine.values), bytes_of(values), byte_counts); });
  bytes_sent += mine.values.size() * sizeof(float);
  std::vector<float> sum(rows.size() * row_len, 0.0f);
  for (size_t i = 0; i < all.index.size(); ++i) {
    add_row(&sum[position(rows, all.index[i]) * row_len], &values[i * row_len], row_len);
  }
  return sum;
}

// Union scheme: rank r sums block r of the union over ranks, then the blocks are allgathered.
std::vector<float> sum_by_union(Transport& t, const std::string& name, const Rows& mine,
                                const std::vector<int64_t>& rows, size_t row_len,
                                size_t& bytes_sent) {
  const auto world = static_cast<size_t>(t.size());
  const auto me = static_cast<size_t>(t.rank());
  const size_t u = rows.size();
  auto block_begin = [&](size_t r) { return u * r / world; };
  std::vector<float> spread(u * row_len, 0.0f);  // this rank's rows at their union positions
  for (size_t i = 0; i < mine.index.size(); ++i) {
    std::memcpy(&spread[position(rows, mine.index[i]) * row_len], &mine.values[i * row_len],
                row_len * sizeof(float));
  }
  std::vector<size_t> send_counts, receive_counts, block_bytes;
  const size_t my_rows = block_begin(me + 1) - block_begin(me);
  for (size_t r = 0; r < world; ++r) {
    block_bytes.push_back((block_begin(r + 1) - block_begin(r)) * row_len * sizeof(float));
    send_counts.push_back(block_bytes.back());
    receive_counts.push_back(my_rows * row_len * sizeof(float));
  }
  std::vector<float> received(world * my_rows * row_len);
  run(t, name, "union blocks", [&] {
    return t.alltoallv(bytes_of(spread), send_counts, bytes_of(received), receive_counts);
  });
  std::vector<float> block(my_rows * row_len, 0.0f);
  for (size_t r = 0; r < world; ++r) {  // rank order, so every rank's sums are alike
    for (size_t i = 0; i < my_rows; ++i) {
      add_row(&block[i * row_len], &received[(r * my_rows + i) * row_len], row_len);
    }
  }
  std::vector<float> sum(u * row_len);
  run(t, name, "summed blocks",
      [&] { return t.allgatherv(bytes_of(block), bytes_of(sum), block_bytes); });
  bytes_sent += spread.size() * sizeof(float) + block.size() * sizeof(float);
  return sum;
}

}  // namespace

SparseMean sparse_rows_mean(Transport& transport, const std::string& name,
                            const at::Tensor& param, const at::Tensor& grad) {
  const int64_t table_rows = param.size(0);
  const size_t row_len = table_rows == 0 ? 0 : static_cast<size_t>(param.numel() / table_rows);
  const Rows mine = local_rows(name, param, grad, row_len);
  SparseMean mean;
  mean.dense_bytes = static_cast<size_t>(param.numel()) * sizeof(float);
  const AllIndex all = gather_index(transport, name, mine);
  mean.bytes_sent = sizeof(uint64_t) + mine.index.size() * sizeof(int64_t);
  const std::vector<int64_t> rows = union_of(name, all.index, table_rows);
  // Bytes each rank receives: every rank's rows, or about twice the union.
  const std::vector<float> sum =
      all.index.size() <= 2 * rows.size()
          ? sum_by_allgather(transport, name, mine, all, rows, row_len, mean.bytes_sent)
          : sum_by_union(transport, name, mine, rows, row_len, mean.bytes_sent);
  at::Tensor values = at::empty({static_cast<int64_t>(rows.size()), static_cast<int64_t>(row_len)},
                                at::TensorOptions().dtype(at::kFloat));
  const float world = static_cast<float>(transport.size());
  float* out = values.data_ptr<float>();
  for (size_t i = 0; i < sum.size(); ++i) {
    out[i] = sum[i] / world;
    mean.finite = mean.finite && std::isfinite(out[i]);
  }
  std::vector<int64_t> value_shape{static_cast<int64_t>(rows.size())};
  for (int64_t d = 1; d < param.dim(); ++d) value_shape.push_back(param.size(d));
  at::Tensor index = at::empty({1, static_cast<int64_t>(rows.size())},
                               at::TensorOptions().dtype(at::kLong));
  std::copy(rows.begin(), rows.end(), index.data_ptr<int64_t>());
  mean.grad = at::_sparse_coo_tensor_unsafe(index, values.reshape(value_shape).to(param.scalar_type()),
                                            param.sizes())
                  ._coalesced_(true);
  return mean;
}

}  // namespace gradcomp::torch
