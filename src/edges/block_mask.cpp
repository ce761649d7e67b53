// Block masks (include/attnkit/block_mask.h): building them from mask
// functions a chunk of query rows at a time, combining, checking and
// expanding them, and the named mask functions.
#include <attnkit/block_mask.h>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <bitset>
#include <climits>
#include <cstring>
#include <tuple>
#include <memory>
#include <utility>

namespace attnkit {

namespace {

int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

/// The geometry of a mask's grid, and the in-grid extent of each block (the
/// last block of a row or column is cut by L or S).
struct Grid {
  int64_t L, S, q_block, kv_block;
  int64_t q_blocks() const { return blocks_of(L, q_block); }
  int64_t kv_blocks() const { return blocks_of(S, kv_block); }
  int64_t row_bytes() const { return (kv_block + 7) / 8; }
  int64_t block_bytes() const { return q_block * row_bytes(); }
  int64_t rows_in(int64_t qb) const { return std::min(q_block, L - qb * q_block); }
  int64_t cols_in(int64_t kb) const { return std::min(kv_block, S - kb * kv_block); }
};

Grid grid_of(const BlockMask& m) { return {m.q_len, m.kv_len, m.q_block, m.kv_block}; }

void check_geometry(const char* op, int64_t L, int64_t S, int64_t q_block, int64_t kv_block) {
  TORCH_CHECK(L >= 0 && S >= 0, op, ": lengths must be >= 0, got L = ", L, ", S = ", S);
  TORCH_CHECK(q_block >= 1 && kv_block >= 1, op, ": block sizes must be >= 1, got q_block = ", q_block,
              ", kv_block = ", kv_block);
}

torch::Tensor empty_bits(int64_t count, const Grid& g) {
  return torch::zeros({count, g.q_block, g.row_bytes()}, torch::kUInt8);
}

/// The set bits of a partial block, within its in-grid extent (bits beyond
/// it are 0 by the mask's invariant).
int64_t count_bits(const uint8_t* block, int64_t bytes) {
  int64_t n = 0;
  for (int64_t i = 0; i < bytes; ++i) n += std::bitset<8>(block[i]).count();
  return n;
}

/// The kind that bits with `set` of `area` in-grid pairs make.
BlockKind kind_of(int64_t set, int64_t area) {
  return set == 0 ? BlockKind::empty : set == area ? BlockKind::full : BlockKind::partial;
}

/// A mask under construction from blocks given one at a time, in any order:
/// partial blocks' bits are appended.
class Assembler {
 public:
  Assembler(int64_t batch, int64_t heads, const Grid& g)
      : g_(g),
        kinds_(torch::zeros({batch, heads, g.q_blocks(), g.kv_blocks()}, torch::kUInt8)),
        partial_(torch::full({batch, heads, g.q_blocks(), g.kv_blocks()}, -1, torch::kInt)) {}

  uint8_t* kind(int64_t b, int64_t h, int64_t qb, int64_t kb) {
    return kinds_.data_ptr<uint8_t>() + ((b * kinds_.size(1) + h) * kinds_.size(2) + qb) * kinds_.size(3) + kb;
  }
  int32_t* partial(int64_t b, int64_t h, int64_t qb, int64_t kb) {
    return partial_.data_ptr<int32_t>() + ((b * partial_.size(1) + h) * partial_.size(2) + qb) * partial_.size(3) + kb;
  }
  /// Sets block (b, h, qb, kb) from `bits` (block_bytes() bytes), whose kind
  /// is decided by counting them.
  void set_from_bits(int64_t b, int64_t h, int64_t qb, int64_t kb, const uint8_t* bits) {
    const auto k = kind_of(count_bits(bits, g_.block_bytes()), g_.rows_in(qb) * g_.cols_in(kb));
    *kind(b, h, qb, kb) = static_cast<uint8_t>(k);
    if (k != BlockKind::partial) return;
    *partial(b, h, qb, kb) = static_cast<int32_t>(bits_.size() / g_.block_bytes());
    bits_.insert(bits_.end(), bits, bits + g_.block_bytes());
  }

  BlockMask finish() {
    BlockMask m;
    m.q_len = g_.L;
    m.kv_len = g_.S;
    m.q_block = g_.q_block;
    m.kv_block = g_.kv_block;
    m.kinds = kinds_;
    m.partial_index = partial_;
    const auto count = static_cast<int64_t>(bits_.size()) / g_.block_bytes();
    m.bits = empty_bits(count, g_);
    if (count > 0) std::memcpy(m.bits.data_ptr<uint8_t>(), bits_.data(), bits_.size());
    return m;
  }

 private:
  Grid g_;
  torch::Tensor kinds_, partial_;
  std::vector<uint8_t> bits_;
};

/// Reads a mask's blocks: each block's kind and, for a partial one, its bits.
class BlockReader {
 public:
  explicit BlockReader(const BlockMask& m)
      : m_(m), kinds_(m.kinds.contiguous()), partial_(m.partial_index.contiguous()), bits_(m.bits.contiguous()) {}
  uint8_t kind(int64_t b, int64_t h, int64_t qb, int64_t kb) const { return kinds_.data_ptr<uint8_t>()[at(b, h, qb, kb)]; }
  /// The bits of a partial block; nullptr for another kind.
  const uint8_t* bits(int64_t b, int64_t h, int64_t qb, int64_t kb) const {
    const int32_t i = partial_.data_ptr<int32_t>()[at(b, h, qb, kb)];
    return i < 0 ? nullptr : bits_.data_ptr<uint8_t>() + i * grid_of(m_).block_bytes();
  }

 private:
  int64_t at(int64_t b, int64_t h, int64_t qb, int64_t kb) const {
    b = m_.batch() == 1 ? 0 : b;
    h = m_.heads() == 1 ? 0 : h;
    return ((b * m_.heads() + h) * m_.q_blocks() + qb) * m_.kv_blocks() + kb;
  }
  const BlockMask& m_;
  torch::Tensor kinds_, partial_, bits_;
};

/// a op b over two masks of one grid, block by block: `op` takes the two
/// blocks' bits (all set for a full block, all clear for an empty one) and
/// writes the result's.
template <class Op>
BlockMask combine(const char* what, const BlockMask& a, const BlockMask& b, Op op) {
  TORCH_CHECK(a.q_len == b.q_len && a.kv_len == b.kv_len && a.q_block == b.q_block && a.kv_block == b.kv_block,
              what, ": the masks must cover the same grid with the same blocks, got L x S = ", a.q_len, " x ",
              a.kv_len, " in blocks of ", a.q_block, " x ", a.kv_block, " and ", b.q_len, " x ", b.kv_len,
              " in blocks of ", b.q_block, " x ", b.kv_block);
  auto size = [&](int64_t x, int64_t y, const char* name) {
    TORCH_CHECK(x == y || x == 1 || y == 1, what, ": the masks' ", name, " must be equal or 1, got ", x, " and ", y);
    return std::max(x, y);
  };
  const int64_t B = size(a.batch(), b.batch(), "batch sizes"), H = size(a.heads(), b.heads(), "head counts");
  const Grid g = grid_of(a);
  const BlockReader ra(a), rb(b);
  Assembler out(B, H, g);
  std::vector<uint8_t> full(g.block_bytes()), none(g.block_bytes(), 0), result(g.block_bytes());
  for (int64_t qb = 0; qb < g.q_blocks(); ++qb)
    for (int64_t kb = 0; kb < g.kv_blocks(); ++kb) {
      // All in-grid bits of this block set.
      std::fill(full.begin(), full.end(), 0);
      for (int64_t r = 0; r < g.rows_in(qb); ++r)
        for (int64_t c = 0; c < g.cols_in(kb); ++c) full[r * g.row_bytes() + c / 8] |= uint8_t(1u << (c % 8));
      for (int64_t bi = 0; bi < B; ++bi)
        for (int64_t hi = 0; hi < H; ++hi) {
          auto bits = [&](const BlockReader& r) -> const uint8_t* {
            const auto kind = r.kind(bi, hi, qb, kb);
            if (kind == uint8_t(BlockKind::full)) return full.data();
            if (kind == uint8_t(BlockKind::empty)) return none.data();
            return r.bits(bi, hi, qb, kb);
          };
          const uint8_t* x = bits(ra);
          const uint8_t* y = bits(rb);
          for (int64_t i = 0; i < g.block_bytes(); ++i) result[i] = op(x[i], y[i]);
          out.set_from_bits(bi, hi, qb, kb, result.data());
        }
    }
  return out.finish();
}

}  // namespace

int64_t BlockMask::bytes() const {
  return kinds.numel() * 1 + partial_index.numel() * 4 + bits.numel() * 1;
}

double BlockMask::visited_fraction() const {
  const Grid g = grid_of(*this);
  if (g.L == 0 || g.S == 0 || kinds.numel() == 0) return 0;
  const auto k = kinds.accessor<uint8_t, 4>();
  double visited = 0;
  for (int64_t b = 0; b < batch(); ++b)
    for (int64_t h = 0; h < heads(); ++h)
      for (int64_t qb = 0; qb < q_blocks(); ++qb)
        for (int64_t kb = 0; kb < kv_blocks(); ++kb)
          if (k[b][h][qb][kb] != uint8_t(BlockKind::empty)) visited += double(g.rows_in(qb)) * g.cols_in(kb);
  return visited / (double(batch()) * heads() * g.L * g.S);
}

bool BlockMask::sees(int64_t b, int64_t h, int64_t q, int64_t kv) const {
  TORCH_CHECK(q >= 0 && q < q_len && kv >= 0 && kv < kv_len, "BlockMask::sees: (q, kv) = (", q, ", ", kv,
              ") is outside the ", q_len, " x ", kv_len, " grid");
  b = batch() == 1 ? 0 : b;
  h = heads() == 1 ? 0 : h;
  const int64_t qb = q / q_block, kb = kv / kv_block;
  const BlockReader reader(*this);
  const auto kind = reader.kind(b, h, qb, kb);
  if (kind != uint8_t(BlockKind::partial)) return kind == uint8_t(BlockKind::full);
  const uint8_t* bits = reader.bits(b, h, qb, kb);
  const int64_t c = kv - kb * kv_block;
  return (bits[(q - qb * q_block) * grid_of(*this).row_bytes() + c / 8] >> (c % 8)) & 1;
}

torch::Tensor BlockMask::to_dense() const {
  const Grid g = grid_of(*this);
  auto dense = torch::zeros({batch(), heads(), g.L, g.S}, torch::kBool);
  auto d = dense.accessor<bool, 4>();
  const BlockReader reader(*this);
  for (int64_t b = 0; b < batch(); ++b)
    for (int64_t h = 0; h < heads(); ++h)
      for (int64_t qb = 0; qb < q_blocks(); ++qb)
        for (int64_t kb = 0; kb < kv_blocks(); ++kb) {
          const auto kind = reader.kind(b, h, qb, kb);
          if (kind == uint8_t(BlockKind::empty)) continue;
          const uint8_t* bits = reader.bits(b, h, qb, kb);  // nullptr for a full block
          for (int64_t r = 0; r < g.rows_in(qb); ++r)
            for (int64_t c = 0; c < g.cols_in(kb); ++c)
              d[b][h][qb * g.q_block + r][kb * g.kv_block + c] =
                  bits == nullptr || ((bits[r * g.row_bytes() + c / 8] >> (c % 8)) & 1);
        }
  return dense;
}

MaskBlocks mask_blocks(const torch::Tensor& rows_in, int64_t q_block, int64_t kv_block, int64_t first_partial) {
  constexpr const char* op = "mask_blocks";
  TORCH_CHECK(rows_in.defined() && rows_in.dim() == 4 && rows_in.scalar_type() == torch::kBool, op,
              ": the rows must be a bool tensor (B, H, R, S)", rows_in.defined() ? ", got " : "",
              rows_in.defined() ? rows_in.toString() + " of shape " + c10::str(rows_in.sizes()) : std::string());
  TORCH_CHECK(first_partial >= 0, op, ": first_partial must be >= 0, got ", first_partial);
  check_geometry(op, rows_in.size(2), rows_in.size(3), q_block, kv_block);
  const auto rows = rows_in.contiguous();
  const int64_t B = rows.size(0), H = rows.size(1), R = rows.size(2), S = rows.size(3);
  const Grid g{R, S, q_block, kv_block};
  const int64_t QB = g.q_blocks(), KB = g.kv_blocks();
  auto kinds = torch::zeros({B, H, QB, KB}, torch::kUInt8);
  auto partial = torch::full({B, H, QB, KB}, -1, torch::kInt);
  const bool* data = rows.data_ptr<bool>();
  uint8_t* kind = kinds.data_ptr<uint8_t>();
  // Each block's visible pairs counted, one task per block row (b, h, qb).
  at::parallel_for(0, B * H * QB, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> visible(KB);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t qb = t % QB;
      std::fill(visible.begin(), visible.end(), 0);
      for (int64_t r = qb * q_block; r < qb * q_block + g.rows_in(qb); ++r) {
        const bool* row = data + (t / QB * R + r) * S;
        for (int64_t kb = 0; kb < KB; ++kb)
          visible[kb] += std::count(row + kb * kv_block, row + kb * kv_block + g.cols_in(kb), true);
      }
      for (int64_t kb = 0; kb < KB; ++kb)
        kind[t * KB + kb] = static_cast<uint8_t>(kind_of(visible[kb], g.rows_in(qb) * g.cols_in(kb)));
    }
  });
  // The partial blocks numbered in order, then their bits packed in parallel.
  std::vector<int64_t> order;
  int32_t* index = partial.data_ptr<int32_t>();
  for (int64_t i = 0; i < kinds.numel(); ++i)
    if (kind[i] == uint8_t(BlockKind::partial)) {
      TORCH_CHECK(first_partial + int64_t(order.size()) < INT32_MAX, op, ": more than 2^31 - 1 partial blocks");
      index[i] = static_cast<int32_t>(first_partial + order.size());
      order.push_back(i);
    }
  auto bits = empty_bits(static_cast<int64_t>(order.size()), g);
  uint8_t* out = bits.data_ptr<uint8_t>();
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t i = order[p], kb = i % KB, qb = i / KB % QB, bh = i / KB / QB;
      uint8_t* block = out + p * g.block_bytes();
      for (int64_t r = 0; r < g.rows_in(qb); ++r) {
        const bool* row = data + (bh * R + qb * q_block + r) * S + kb * kv_block;
        for (int64_t c = 0; c < g.cols_in(kb); ++c)
          if (row[c]) block[r * g.row_bytes() + c / 8] |= uint8_t(1u << (c % 8));
      }
    }
  });
  return {kinds, partial, bits};
}

BlockMask create_block_mask(const MaskFunction& mask, int64_t batch, int64_t heads, int64_t L, int64_t S,
                            int64_t q_block, int64_t kv_block) {
  constexpr const char* op = "create_block_mask";
  TORCH_CHECK(static_cast<bool>(mask), op, ": no mask function given");
  TORCH_CHECK(batch >= 1 && heads >= 1, op, ": batch and heads must be >= 1 (1: the same mask for all), got ",
              batch, " and ", heads);
  check_geometry(op, L, S, q_block, kv_block);
  const Grid g{L, S, q_block, kv_block};
  // Chunks of whole query blocks, about 16 MiB of bools each (at least one block row).
  const int64_t chunk_blocks = std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(1, q_block * S));
  std::vector<torch::Tensor> bits;
  int64_t partial_count = 0;
  auto all_kinds = torch::zeros({batch, heads, g.q_blocks(), g.kv_blocks()}, torch::kUInt8);
  auto all_partial = torch::full({batch, heads, g.q_blocks(), g.kv_blocks()}, -1, torch::kInt);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t qb = 0; qb < g.q_blocks(); qb += chunk_blocks) {
        const int64_t q0 = qb * q_block, rows = std::min(L, q0 + chunk_blocks * q_block) - q0;
        auto chunk = torch::empty({1, 1, rows, S}, torch::kBool);
        bool* data = chunk.data_ptr<bool>();
        at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r)
            for (int64_t kv = 0; kv < S; ++kv) data[r * S + kv] = mask(b, h, q0 + r, kv);
        });
        auto m = mask_blocks(chunk, q_block, kv_block, partial_count);
        const int64_t n = m.kinds.size(2);
        all_kinds[b][h].narrow(0, qb, n).copy_(m.kinds[0][0]);
        all_partial[b][h].narrow(0, qb, n).copy_(m.partial_index[0][0]);
        bits.push_back(m.bits);
        partial_count += m.bits.size(0);
      }
  BlockMask out;
  out.q_len = L;
  out.kv_len = S;
  out.q_block = q_block;
  out.kv_block = kv_block;
  out.kinds = all_kinds;
  out.partial_index = all_partial;
  out.bits = bits.empty() ? empty_bits(0, g) : torch::cat(bits);
  return out;
}

BlockMask block_mask_and(const BlockMask& a, const BlockMask& b) {
  return combine("block_mask_and", a, b, [](uint8_t x, uint8_t y) { return uint8_t(x & y); });
}

BlockMask block_mask_or(const BlockMask& a, const BlockMask& b) {
  return combine("block_mask_or", a, b, [](uint8_t x, uint8_t y) { return uint8_t(x | y); });
}

void check_block_mask(const char* op, const BlockMask& m, int64_t batch, int64_t heads, int64_t L, int64_t S) {
  check_geometry(op, m.q_len, m.kv_len, m.q_block, m.kv_block);
  TORCH_CHECK(m.q_len == L && m.kv_len == S, op, ": the block mask covers ", m.q_len, " x ", m.kv_len,
              " (L x S), the inputs are ", L, " x ", S);
  const Grid g = grid_of(m);
  auto check = [&](const torch::Tensor& t, const char* name, torch::ScalarType type, int64_t dim) {
    TORCH_CHECK(t.defined() && t.scalar_type() == type && t.dim() == dim && t.device().is_cpu(), op,
                ": the block mask's ", name, " must be a CPU ", c10::toString(type), " tensor of ", dim,
                " dimensions", t.defined() ? ", got " + t.toString() + " of shape " + c10::str(t.sizes()) : "");
  };
  check(m.kinds, "kinds", torch::kUInt8, 4);
  check(m.partial_index, "partial_index", torch::kInt, 4);
  check(m.bits, "bits", torch::kUInt8, 3);
  TORCH_CHECK(m.kinds.size(2) == g.q_blocks() && m.kinds.size(3) == g.kv_blocks(), op,
              ": the block mask's kinds must have ceil(L / q_block) x ceil(S / kv_block) = ", g.q_blocks(), " x ",
              g.kv_blocks(), " blocks, got ", m.kinds.size(2), " x ", m.kinds.size(3));
  TORCH_CHECK(m.partial_index.sizes() == m.kinds.sizes(), op, ": the block mask's partial_index must have kinds' "
              "shape ", m.kinds.sizes(), ", got ", m.partial_index.sizes());
  TORCH_CHECK(m.bits.size(1) == g.q_block && m.bits.size(2) == g.row_bytes(), op, ": the block mask's bits must "
              "be (P, q_block, ceil(kv_block / 8)) = (P, ", g.q_block, ", ", g.row_bytes(), "), got ", m.bits.sizes());
  for (auto [size, want, name] : {std::tuple{m.batch(), batch, "batch size"}, std::tuple{m.heads(), heads, "head count"}})
    TORCH_CHECK(size == want || size == 1, op, ": the block mask's ", name, " is ", size, "; the inputs' is ", want,
                " (a mask is for every batch entry or head with 1)");
  const auto kinds = m.kinds.contiguous(), partial = m.partial_index.contiguous();
  const uint8_t* k = kinds.data_ptr<uint8_t>();
  const int32_t* p = partial.data_ptr<int32_t>();
  const int64_t P = m.bits.size(0), QB = g.q_blocks(), KB = g.kv_blocks();
  const auto bits = m.bits.contiguous();
  for (int64_t i = 0; i < kinds.numel(); ++i) {
    TORCH_CHECK(k[i] <= uint8_t(BlockKind::partial), op, ": the block mask's kinds hold ", int(k[i]),
                " at block ", i, " (0 empty, 1 full, 2 partial)");
    const bool is_partial = k[i] == uint8_t(BlockKind::partial);
    TORCH_CHECK(is_partial ? (p[i] >= 0 && p[i] < P) : p[i] == -1, op, ": the block mask's partial_index is ",
                p[i], " at block ", i, is_partial ? ", a partial block, outside [0, " + std::to_string(P) + ")"
                                                  : ", which is not partial (its index must be -1)");
    if (!is_partial) continue;
    // Bits outside the grid (a block cut by L or S) must be clear: kernels read whole rows.
    const int64_t qb = i / KB % QB, kb = i % KB;
    const uint8_t* block = bits.data_ptr<uint8_t>() + p[i] * g.block_bytes();
    for (int64_t r = 0; r < g.q_block; ++r)
      for (int64_t byte = 0; byte < g.row_bytes(); ++byte) {
        const int64_t valid = r < g.rows_in(qb) ? std::clamp<int64_t>(g.cols_in(kb) - byte * 8, 0, 8) : 0;
        const uint8_t outside = uint8_t(0xFFu << valid);
        TORCH_CHECK((block[r * g.row_bytes() + byte] & outside) == 0, op, ": the block mask's partial block ", p[i],
                    " (query block ", qb, ", key block ", kb, ") has bits set outside the ", g.L, " x ", g.S,
                    " grid");
      }
  }
}

namespace masks {

MaskFunction causal(int64_t L, int64_t S) {
  return [shift = S - L](int64_t, int64_t, int64_t q, int64_t kv) { return kv <= q + shift; };
}

MaskFunction sliding_window(int64_t L, int64_t S, int64_t window, bool causal) {
  TORCH_CHECK(window >= 1, "masks::sliding_window: window must be >= 1, got ", window);
  return [shift = S - L, window, causal](int64_t, int64_t, int64_t q, int64_t kv) {
    const int64_t d = q + shift - kv;  // the key's distance before the query's position
    return causal ? (d >= 0 && d < window) : (d > -window && d < window);
  };
}

MaskFunction documents(const torch::Tensor& offsets, bool causal) {
  TORCH_CHECK(offsets.defined() && offsets.dim() == 1 && offsets.scalar_type() == torch::kLong &&
                  offsets.numel() >= 1,
              "masks::documents: offsets must be an int64 tensor (D + 1) from 0 to the sequence's length");
  auto o = offsets.contiguous();
  std::vector<int64_t> starts(o.data_ptr<int64_t>(), o.data_ptr<int64_t>() + o.numel());
  TORCH_CHECK(starts.front() == 0 && std::is_sorted(starts.begin(), starts.end()),
              "masks::documents: offsets must start at 0 and not decrease");
  // The document of each position, found once.
  auto doc = std::make_shared<std::vector<int32_t>>(starts.back());
  for (size_t d = 0; d + 1 < starts.size(); ++d)
    std::fill(doc->begin() + starts[d], doc->begin() + starts[d + 1], static_cast<int32_t>(d));
  return [doc, causal](int64_t, int64_t, int64_t q, int64_t kv) {
    const auto n = static_cast<int64_t>(doc->size());
    TORCH_CHECK(q < n && kv < n, "masks::documents: position ", std::max(q, kv), " is past the documents' ", n,
                " tokens");
    return (*doc)[q] == (*doc)[kv] && (!causal || kv <= q);
  };
}

MaskFunction prefix_lm(int64_t L, int64_t S, int64_t prefix) {
  TORCH_CHECK(prefix >= 0, "masks::prefix_lm: prefix must be >= 0, got ", prefix);
  return [shift = S - L, prefix](int64_t, int64_t, int64_t q, int64_t kv) { return kv < prefix || kv <= q + shift; };
}

MaskFunction global_window(int64_t L, int64_t S, int64_t globals, int64_t window, bool causal) {
  TORCH_CHECK(globals >= 0, "masks::global_window: globals must be >= 0, got ", globals);
  auto local = sliding_window(L, S, window, causal);
  return [local, shift = S - L, globals, causal](int64_t b, int64_t h, int64_t q, int64_t kv) {
    if (causal && kv > q + shift) return false;
    return kv < globals || (!causal && q + shift < globals) || local(b, h, q, kv);
  };
}

MaskFunction dilated(int64_t L, int64_t S, int64_t dilation, bool causal) {
  TORCH_CHECK(dilation >= 1, "masks::dilated: dilation must be >= 1, got ", dilation);
  return [shift = S - L, dilation, causal](int64_t, int64_t, int64_t q, int64_t kv) {
    const int64_t d = q + shift - kv;
    return (!causal || d >= 0) && d % dilation == 0;
  };
}

MaskFunction all_of(std::vector<MaskFunction> functions) {
  return [functions = std::move(functions)](int64_t b, int64_t h, int64_t q, int64_t kv) {
    return std::all_of(functions.begin(), functions.end(), [&](const MaskFunction& f) { return f(b, h, q, kv); });
  };
}

MaskFunction any_of(std::vector<MaskFunction> functions) {
  return [functions = std::move(functions)](int64_t b, int64_t h, int64_t q, int64_t kv) {
    return std::any_of(functions.begin(), functions.end(), [&](const MaskFunction& f) { return f(b, h, q, kv); });
  };
}

}  // namespace masks

}  // namespace attnkit
