// One file, long on purpose: the forward (whole rows, or keys split for few queries)
// and the backward share the tile, masking and bias helpers, which no other file uses.
#include "kernels/softmax_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "base/memory.h"
#include "kernels/common/denormals.h"
#include "kernels/common/dropout.h"
#include "kernels/common/gemm.h"
#include "kernels/common/parallel.h"
#include "kernels/common/rotary.h"
#include "kernels/common/strided.h"
#include "kernels/common/vec.h"
#include "kernels/common/visibility.h"
#include "kernels/score_mod.h"
#include "kernels/sparse_band.h"

ATTNKIT_KERNELS_BEGIN

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Block sizes, queries x keys: 128 x 256 was within the noise of the best of
// the shapes tried in both passes (docs/PERFORMANCE.md, "Why the kernels'
// constants", has the measurements). Smaller blocks pay oneDNN's per-call
// overhead (dispatch, packing) more often; larger ones gain nothing more and
// grow the score block (128 KiB here), which with the key and value panels
// must stay in L2. A register-tiled kernel that only replaced sgemm on these
// shapes ran barely faster; what pays is keeping the whole tile, scores,
// softmax and P v, in L1 (by_lanes, below; docs/PERFORMANCE.md, "Against
// torch 2.6's SDPA", has the measurements). The backward and the
// forward with a bias or dropout keep these sgemm tiles.
constexpr int64_t kForwardBlockQ = 128;
constexpr int64_t kForwardBlockK = 256;
// A forward work item is a span of up to kForwardGroup query blocks that share
// every key and value block while it is in L2: once a head's keys and values
// outgrow L2 (L = S = 16384: 8 MiB) spans of 4 blocks ran the forward faster
// than single blocks; where they fit, both are equal (docs/PERFORMANCE.md,
// "Why the kernels' constants").
constexpr int64_t kForwardGroup = 4;

/// The forward's tile: `q` query rows by `k` keys.
struct ForwardTiles {
  int64_t q, k;
};

// With a window W, a block of BQ queries sees a band of keys that is
// (causal ? W : 2 W - 1) + BQ - 1 wide, and each of its rows sees W (or
// 2 W - 1) of them. Tiles of 256 keys would cover a narrow band in two or
// three products, the last one narrow, and compute up to 2x the visible
// pairs; a key tile as wide as the band covers it in one, and few query rows
// keep the band's edges, the pairs computed and masked beyond the visible
// ones, at BQ - 1 per row (docs/PERFORMANCE.md, "Modern features", has the
// tile shapes tried). A band wider than kMaxWindowBlockK keys takes the
// dense tiles, whose waste at its edges is then small; a window wider than
// all the keys is then computed exactly as no window.
//
// A band that is one tile is computed transposed when nothing else is added
// to the scores (forward_band_by_columns): S^T = K Q^T has the band's keys
// as rows and 32 queries as columns, the softmax runs down the columns
// (two vectors per key), and oneDNN's sgemm is faster on that shape than on
// Q K^T's 32 x band (docs/PERFORMANCE.md, "Modern features": 2.16 against
// 2.57 ns per visible pair for the two products at W = 256, causal). 32
// rows then waste less of the band than 64 and lose nothing to the
// products; the row-major path keeps 64, its best.
constexpr int64_t kWindowBlockQ = 64;
constexpr int64_t kColumnBlockQ = 32;
constexpr int64_t kMaxWindowBlockK = 1024;

/// Whether the forward takes a window's band by columns: nothing but the
/// window's own mask acts on the scores (bias, ALiBi and dropout are applied
/// row by row in the row-major path).
bool band_by_columns(const SoftmaxAttentionParams& p) {
  return p.window > 0 && !p.bias && !p.alibi_slopes && !(p.dropout_p > 0.f) && !p.block_mask.active() &&
         !(p.softcap > 0.f) && !p.score_mod.active();
}

/// A block mask's key tiles lie inside its blocks, which the band's tiles
/// would cross: with one, a window is a mask of the dense or lane tiles.
ForwardTiles forward_tiles(const SoftmaxAttentionParams& p) {
  const int64_t bq = band_by_columns(p) ? kColumnBlockQ : kWindowBlockQ;
  const int64_t band = (p.causal ? p.window : 2 * p.window - 1) + bq - 1;
  if (p.window <= 0 || band > kMaxWindowBlockK || p.block_mask.active()) return {kForwardBlockQ, kForwardBlockK};
  return {bq, round_up16(band)};
}
// by_lanes: a block of queries is the band kernels' 32 lanes, a tile of keys
// their 256 (the dense tiles' key width).
#if ATTNKIT_BAND_KERNELS
constexpr int64_t kLaneRows = band::kRows;
static_assert(kForwardBlockK <= band::kMaxKeys, "a key tile wider than the band kernels take");
#else
constexpr int64_t kLaneRows = 32;
#endif
constexpr int64_t kBackwardBlockQ = 128;
constexpr int64_t kBackwardBlockK = 256;
// Dropout draws a tile row's mask in one call (kernels/common/dropout.h).
static_assert(kForwardBlockK <= AttentionDropout::kMaxKeys && kMaxWindowBlockK <= AttentionDropout::kMaxKeys &&
                  kBackwardBlockK <= AttentionDropout::kMaxKeys,
              "a key tile wider than one dropout draw");

/// Query i of batch n sees exactly the keys [visible.first(i), visible(i))
/// before the bias.
Visibility visibility_of(const SoftmaxAttentionParams& p, int64_t n) {
  return Visibility(p.L, p.S, p.causal, key_limit(p.key_lengths, n, p.S), p.window);
}

/// How the passes read q and k: in place or packed as their strides allow
/// (rows_of; with `compact`, packed unless the rows are adjacent:
/// compact_rows_of), or, with rotary positions, rotated into the pack as each
/// block is loaded: query i to position i + S - L, key j to position j (the
/// causal mask's alignment). Its table covers positions [min(0, S - L), S).
class QkReader {
 public:
  explicit QkReader(const SoftmaxAttentionParams& p)
      : p_(p), rotary_(RotaryTable::for_attention(p.rotary_dim, p.rotary_base, p.L, p.S)) {}

  /// Whether every block is rewritten into its pack (then packs are needed
  /// whatever the strides).
  bool rotates() const { return rotary_.active(); }

  /// Rows [i0, i0 + rows) of query head (n, h).
  Rows queries(int64_t n, int64_t h, int64_t i0, int64_t rows, float* pack, bool compact = false) const {
    const Strided m = head_matrix(p_.q, p_.q_stride, n, h);
    if (rotates()) return rotary_.rotated_rows(m, i0, rows, p_.E, query_position(i0), pack);
    return compact ? compact_rows_of(m, i0, rows, p_.E, pack) : rows_of(m, i0, rows, p_.E, pack);
  }
  /// Rows [j0, j0 + rows) of the keys query head (n, h) reads.
  Rows keys(int64_t n, int64_t h, int64_t j0, int64_t rows, float* pack, bool compact = false) const {
    const Strided m = head_matrix(p_.k, p_.k_stride, n, p_.kv_head(h));
    if (rotates()) return rotary_.rotated_rows(m, j0, rows, p_.E, j0, pack);
    return compact ? compact_rows_of(m, j0, rows, p_.E, pack) : rows_of(m, j0, rows, p_.E, pack);
  }
  /// The gradients of rotated rows, rotated back in place: rows [i0, i0 +
  /// rows) of dq, [j0, j0 + rows) of dk (row stride E).
  void unrotate_queries(float* dq, int64_t i0, int64_t rows) const {
    if (rotates()) rotary_.unrotate_rows(dq, rows, p_.E, p_.E, query_position(i0));
  }
  void unrotate_keys(float* dk, int64_t j0, int64_t rows) const {
    if (rotates()) rotary_.unrotate_rows(dk, rows, p_.E, p_.E, j0);
  }

 private:
  int64_t query_position(int64_t i) const { return i + p_.S - p_.L; }

  const SoftmaxAttentionParams& p_;
  RotaryTable rotary_;
};

/// Adds bias[n, h, i0 + r, j0 + c] to s[r * lds + c] for r < rows, c < cols.
void add_bias(const SoftmaxAttentionParams& p, int64_t n, int64_t h, int64_t i0, int64_t rows,
              int64_t j0, int64_t cols, float* s, int64_t lds) {
  const int64_t* st = p.bias_stride;
  const float* b = p.bias + n * st[0] + h * st[1] + i0 * st[2] + j0 * st[3];
  for (int64_t r = 0; r < rows; ++r, b += st[2]) {
    float* sr = s + r * lds;
    if (st[3] == 1) {
      vec::add(sr, b, cols);
    } else {
      for (int64_t c = 0; c < cols; ++c) sr[c] += b[c * st[3]];
    }
  }
}

/// Adds what the scores get besides scale q k^T to the block of rows
/// [i0, i0 + rows) x keys [j0, j0 + cols), s[r * lds + c]: the bias tensor's
/// entries and ALiBi's penalty -slope_h |i + S - L - j|.
void add_score_terms(const SoftmaxAttentionParams& p, int64_t n, int64_t h, int64_t i0, int64_t rows,
                     int64_t j0, int64_t cols, float* s, int64_t lds) {
  if (p.bias) add_bias(p, n, h, i0, rows, j0, cols, s, lds);
  if (p.alibi_slopes) {
    const float slope = p.alibi_slopes[h];
    const int64_t first = i0 + p.S - p.L - j0;  // query row i0's distance to key j0
    for (int64_t r = 0; r < rows; ++r) vec::sub_distance(s + r * lds, cols, static_cast<float>(first + r), slope);
  }
}

/// The call's attention dropout (inactive without one).
AttentionDropout dropout_of(const SoftmaxAttentionParams& p) {
  return AttentionDropout(p.dropout_p, p.dropout_seed, p.dropout_batch_offset);
}

/// Sets the scores of keys a row may not see to -inf in the block of rows
/// [i0, i0 + rows) x keys [j0, j0 + cols), s[r * lds + c].
void mask_block(const Visibility& visible, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                float* s, int64_t lds) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t begin = std::clamp<int64_t>(visible.first(i0 + r) - j0, 0, cols);
    const int64_t end = std::clamp<int64_t>(visible(i0 + r) - j0, begin, cols);
    std::fill(s + r * lds, s + r * lds + begin, -kInf);
    std::fill(s + r * lds + end, s + r * lds + cols, -kInf);
  }
}

/// Whether some row of [i0, i0 + rows) does not see every key of [j0, j0 + cols).
bool needs_mask(const Visibility& visible, int64_t i0, int64_t rows, int64_t j0, int64_t cols) {
  // The first row sees the fewest keys at the end, the last the fewest at the start.
  return j0 + cols > visible(i0) || visible.first(i0 + rows - 1) > j0;
}

/// mask_block, and the block mask's hidden pairs when there is one.
void mask_tile(const SoftmaxAttentionParams& p, const Visibility& visible, int64_t n, int64_t h, int64_t i0,
               int64_t rows, int64_t j0, int64_t cols, float* s, int64_t lds) {
  if (needs_mask(visible, i0, rows, j0, cols)) mask_block(visible, i0, rows, j0, cols, s, lds);
  if (p.block_mask.active()) hide_masked(p.block_mask, n, h, i0, rows, j0, cols, s, lds);
}

/// A tile of keys [j0, j0 + cols); with a block mask, inside its key block kb.
struct KeyTile {
  int64_t j0, cols, kb;
};

/// Calls f(tile) for the forward's key tiles over [begin, end) of the
/// queries [i0, i0 + rows) of head (n, h), in increasing order: without a
/// block mask, tiles of `width` keys from `begin`; with one, the key blocks
/// met by [begin, end) that are not empty for some of the rows' query
/// blocks, each cut into tiles of up to `width` keys from its first key (so
/// a tile may start before `begin`: the caller's visibility masks hide those
/// keys) and ending at `end`. The caller skips the blocks that are empty for
/// the rows at hand (block_kind): a key block's tiles are the same whatever
/// other rows share the call, so results do not depend on how rows are
/// grouped.
template <class F>
void for_each_key_tile(const SoftmaxAttentionParams& p, int64_t n, int64_t h, int64_t i0, int64_t rows,
                       int64_t begin, int64_t end, int64_t width, const F& f) {
  const BlockMaskView& mask = p.block_mask;
  if (!mask.active()) {
    for (int64_t j0 = begin; j0 < end; j0 += width) f(KeyTile{j0, std::min(width, end - j0), -1});
    return;
  }
  const int64_t qb_begin = i0 / mask.q_block, qb_end = ceil_div(i0 + rows, mask.q_block);
  for (int64_t kb = begin / mask.kv_block; kb * mask.kv_block < end; ++kb) {
    bool visited = false;
    for (int64_t qb = qb_begin; qb < qb_end && !visited; ++qb) visited = mask.kind(n, h, qb, kb) != kEmptyBlock;
    if (!visited) continue;
    const int64_t first = kb * mask.kv_block, last = std::min(end, first + mask.kv_block);
    for (int64_t j0 = first; j0 < last; j0 += width)
      if (j0 + width > begin) f(KeyTile{j0, std::min(width, last - j0), kb});
  }
}

/// The block mask's kind of key tile t for query row i (full without a mask).
uint8_t block_kind(const SoftmaxAttentionParams& p, int64_t n, int64_t h, int64_t i, const KeyTile& t) {
  return p.block_mask.active() ? p.block_mask.kind(n, h, i / p.block_mask.q_block, t.kb) : kFullBlock;
}

// ---------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------

/// The online-softmax state of a run of query rows over some of the keys: the
/// unnormalised output u (rows x M), running max m and sum l (rows each).
/// Empty (no visible key yet): u = 0, m = -inf, l = 0.
struct Accumulator {
  float *u, *m, *l;
};

/// Whether the forward computes its tiles with the band kernels
/// (sparse_band.h): blocks of 32 query rows held in the vector lanes, the
/// scores, softmax and P v of each 256-key tile kept in L1 (forward_by_lanes
/// says why). They take ALiBi but no bias tensor or dropout, and a window's
/// narrow band keeps its own tiles (forward_tiles). Fewer than 16 queries
/// (decoding) would fill under half the lanes and compute the padding lanes'
/// scores too: they keep the sgemm tiles. The choice depends on the shape
/// alone, never on how the rows are grouped into work items (which follows
/// the thread count), so the result stays bitwise the same for any count.
bool by_lanes(const SoftmaxAttentionParams& p) {
#if ATTNKIT_BAND_KERNELS
  // A score modifier runs on row-major tiles (score_mod.h).
  return !p.bias && !(p.dropout_p > 0.f) && (p.window == 0 || p.block_mask.active()) && p.L >= 16 &&
         !p.score_mod.active();
#else
  (void)p;
  return false;
#endif
}

struct ForwardScratch {
  float *q, *k, *v;  // packed copies of blocks when the strides need it
  float *s;          // scores, then probabilities: one tile (forward_tiles)
  Accumulator acc;   // for up to `rows` query rows
  // by_lanes: the queries transposed, E x 32 per block of 32 rows, and one
  // tile's state (u: 32 x M, m and l) before it joins acc.
  float* qt = nullptr;
  Accumulator tile{};
  float* regs;  // a score modifier's registers over one key tile (score_mod::scratch_floats)

  /// Scratch for work items of up to `rows` query rows.
  ForwardScratch(const SoftmaxAttentionParams& p, Slicer& slicer, int64_t rows)
      : q(slicer.take(rows * p.E)),
        k(slicer.take(forward_tiles(p).k * p.E)),
        v(slicer.take(forward_tiles(p).k * p.M)),
        s(slicer.take(forward_tiles(p).q * forward_tiles(p).k)),
        acc{slicer.take(rows * p.M), slicer.take(rows), slicer.take(rows)},
        regs(slicer.take(p.score_mod.active() ? score_mod::scratch_floats(p.score_mod.size, forward_tiles(p).k) : 0)) {
    if (!by_lanes(p)) return;
    qt = slicer.take(ceil_div(rows, kLaneRows) * kLaneRows * p.E);
    tile = {slicer.take(kLaneRows * p.M), slicer.take(kLaneRows), slicer.take(kLaneRows)};
  }
};

/// forward_keys for one tile: queries [i0, i0 + rows) over the keys
/// [j0, j0 + cols) of a window's band (band_by_columns), transposed. The
/// scores S^T = K Q^T (cols x rows) give m = the column maxima over each
/// query's visible keys, P^T = exp(S^T - m) on them (0 elsewhere) and
/// l = the column sums, then u = P V. One tile needs no rescaling: `a` gets
/// u, m and l as they are.
void forward_band_by_columns(const SoftmaxAttentionParams& p, const QkReader& qk, const Rows& q, int64_t n,
                             int64_t h, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                             const ForwardScratch& w, const Accumulator& a) {
  const int64_t E = p.E, M = p.M;
  const Visibility visible = visibility_of(p, n);
  const Rows k = qk.keys(n, h, j0, cols, w.k);
  const Rows v = rows_of(head_matrix(p.v, p.v_stride, n, p.kv_head(h)), j0, cols, M, w.v);
  float* st = w.s;  // cols x rows
  sgemm(false, true, cols, rows, E, p.scale, k.data, k.ld, q.data, q.ld, 0.f, st, rows);
  // Each query's visible keys [lo, hi) within this tile's [j0, j0 + cols),
  // which the caller checked fits int32.
  int32_t lo[kColumnBlockQ], hi[kColumnBlockQ];
  float shift[kColumnBlockQ];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t first = std::clamp(visible.first(i0 + r), j0, j0 + cols);
    lo[r] = static_cast<int32_t>(first);
    hi[r] = static_cast<int32_t>(std::clamp(visible(i0 + r), first, j0 + cols));
  }
  vec::column_max(st, cols, rows, rows, j0, lo, hi, a.m);
  // A query with no visible key: P = 0, l = 0, m stays -inf.
  for (int64_t r = 0; r < rows; ++r) shift[r] = a.m[r] == -kInf ? 0.f : a.m[r];
  vec::column_exp_sum(st, cols, rows, rows, j0, lo, hi, shift, a.l);
  // column_max may drop a NaN score; the sum keeps it. A NaN m too, as the
  // row-major path leaves it, so that a key split's merge keeps the chunk.
  for (int64_t r = 0; r < rows; ++r)
    if (std::isnan(a.l[r])) a.m[r] = a.l[r];
  sgemm(true, false, rows, M, cols, 1.f, st, rows, v.data, v.ld, 0.f, a.u, M);
}

#if ATTNKIT_BAND_KERNELS
/// The bits of a partial block of the block mask for the band kernels
/// (band::Block::bits): rows [i, i + rows) of query block qb (the padding
/// rows' bits clear) over the keys [j0, j0 + cols) of key block kb, where
/// j0 - kb kv_block is a multiple of 8 (for_each_key_tile's tiles start at a
/// multiple of 256 into a block). Bits past the block's row are clear.
/// Returns the first of the `cols` keys some row sees and one past the last
/// ({0, 0}: none).
std::pair<int64_t, int64_t> lane_bits(const BlockMaskView& mask, int64_t n, int64_t h, int64_t qb, int64_t kb,
                                      int64_t i, int64_t rows, int64_t j0, int64_t cols, uint32_t* bits) {
  const int64_t offset = (j0 - kb * mask.kv_block) / 8, row_bytes = mask.row_bytes();
  int64_t first_seen = -1, seen = 0;
  for (int64_t g = 0; g < ceil_div(cols, 32); ++g) {
    const int64_t from = offset + 4 * g, bytes = std::clamp<int64_t>(row_bytes - from, 0, 4);
    uint32_t any = 0;
    for (int64_t r = 0; r < kLaneRows; ++r) {
      uint32_t word = 0;  // little-endian, as x86: byte t holds bits 8 t to 8 t + 7
      if (r < rows) std::memcpy(&word, mask.bit_row(n, h, qb, kb, i + r - qb * mask.q_block) + from, bytes);
      bits[g * kLaneRows + r] = word;
      any |= word;
    }
    if (cols - 32 * g < 32) any &= (1u << (cols - 32 * g)) - 1u;  // keys past cols do not count
    if (!any) continue;
    if (first_seen < 0) first_seen = 32 * g + __builtin_ctz(any);
    seen = 32 * g + 32 - __builtin_clz(any);
  }
  return {std::max<int64_t>(first_seen, 0), seen};
}

/// a = the state of the online softmax after it joins a tile's state t (both
/// over `rows` rows): m = max(m_a, m_t), and u and l the sums of each side's
/// weighted by exp(m_side - m). A NaN of either side makes l NaN.
void join_tile(const Accumulator& a, const Accumulator& t, int64_t rows, int64_t M) {
  for (int64_t r = 0; r < rows; ++r) {
    if (t.m[r] == -kInf) continue;  // no visible key in the tile: u_t = 0, l_t = 0
    const float m = std::max(t.m[r], a.m[r]);
    const float alpha = vec::exp(a.m[r] - m), beta = vec::exp(t.m[r] - m);  // exp(-inf) == 0
    a.l[r] = a.l[r] * alpha + t.l[r] * beta;
    float* u = a.u + r * M;
    vec::scale(u, M, alpha);
    vec::axpy(u, beta, t.u + r * M, M);
    a.m[r] = m;
  }
}

/// forward_keys by the band kernels (by_lanes): `a` (zeroed by the caller)
/// gets queries [i0, i0 + rows) over their visible keys of [j_begin, j_end),
/// in blocks of 32 rows, each tile of keys meeting every block in turn. The
/// queries are transposed once; each tile's scores (256 keys x 32 rows, 32 KiB), their
/// softmax and the product with v stay in L1 and registers, where the dense
/// path writes a 128 x 256 tile to L2 and reads it three times, and oneDNN
/// packs both operands of each product. Each tile runs its own softmax (its
/// row maxima), joined to the block's state by join_tile, as forward_split
/// joins key chunks. False (nothing done) when q's row stride is too wide for
/// the kernels' 32-bit gathers.
bool forward_by_lanes(const SoftmaxAttentionParams& p, const QkReader& qk, const Rows& q, int64_t n, int64_t h,
                      int64_t i0, int64_t rows, int64_t j_begin, int64_t j_end, const ForwardScratch& w,
                      const Accumulator& a) {
  if (q.ld * kLaneRows > std::numeric_limits<int32_t>::max()) return false;
  const int64_t E = p.E, M = p.M, BK = kForwardBlockK;
  const Visibility visible = visibility_of(p, n);
  const Strided vh = head_matrix(p.v, p.v_stride, n, p.kv_head(h));
  const band::Scratch scratch{nullptr, nullptr, w.s, nullptr};
  // Every block's queries transposed once, block b's at qt + b E kLaneRows:
  // when a tile first meets the block (a block mask may leave a block
  // nothing to see), which the first 64 blocks note in `transposed`.
  uint64_t transposed = 0;
  for (int64_t b = 64 * kLaneRows; b < rows; b += kLaneRows)
    band::transpose_queries({q.data + b * q.ld, q.ld}, std::min(kLaneRows, rows - b), E, w.qt + b * E);
  const auto queries = [&](int64_t b) {
    const int64_t block = b / kLaneRows;
    if (block < 64 && !(transposed >> block & 1)) {
      band::transpose_queries({q.data + b * q.ld, q.ld}, std::min(kLaneRows, rows - b), E, w.qt + b * E);
      transposed |= uint64_t{1} << block;
    }
    return w.qt + b * E;
  };
  // Key tiles outer: each tile of k and v is read (and packed or rotated)
  // once for all the item's blocks, which then find it in L2.
  const int64_t span_begin = std::max(j_begin, visible.first(i0));
  const int64_t span_end = std::min(j_end, visible(i0 + rows - 1));
  alignas(64) int32_t first[kLaneRows], last[kLaneRows];
  alignas(64) uint32_t bits[band::kMaxKeys / 32 * kLaneRows];
  for_each_key_tile(p, n, h, i0, rows, span_begin, span_end, BK, [&](const KeyTile& key_tile) {
    const int64_t j0 = key_tile.j0, span_cols = key_tile.cols;
    const Rows k = qk.keys(n, h, j0, span_cols, w.k);
    const Rows v = rows_of(vh, j0, span_cols, M, w.v);
    for (int64_t b = 0; b < rows; b += kLaneRows) {
      const int64_t block_rows = std::min(kLaneRows, rows - b), i = i0 + b;
      const int64_t key_end = std::min(j_end, visible(i + block_rows - 1));
      if (j0 >= key_end || j0 + span_cols <= visible.first(i)) continue;  // nothing here for the block
      const uint8_t kind = block_kind(p, n, h, i, key_tile);
      if (kind == kEmptyBlock) continue;
      int64_t cols = std::min(span_cols, key_end - j0);
      // A partial block's bits: the block's rows see keys in [skip, seen)
      // of the tile at most, so only those are computed (a causal
      // diagonal's lane blocks, a few global keys), from a whole word of bits.
      int64_t skip = 0;
      const bool partial = kind == kPartialBlock;
      if (partial) {
        const int64_t qb = i / p.block_mask.q_block;
        const auto [first_seen, seen] = lane_bits(p.block_mask, n, h, qb, key_tile.kb, i, block_rows, j0, cols, bits);
        if (seen == 0) continue;  // no row of the block sees a key of the tile
        skip = first_seen / 32 * 32;
        cols = seen;
      }
      const int64_t js = j0 + skip;
      cols -= skip;
      // Row r sees the keys [first, last) from js (padding rows none).
      std::fill(first, first + kLaneRows, 0);
      std::fill(last, last + kLaneRows, 0);
      for (int64_t r = 0; r < block_rows; ++r) {
        first[r] = static_cast<int32_t>(std::clamp<int64_t>(visible.first(i + r) - js, 0, cols));
        last[r] = static_cast<int32_t>(std::clamp<int64_t>(visible(i + r) - js, first[r], cols));
      }
      band::Block tile{block_rows, cols, first, last};
      if (p.alibi_slopes) tile.slope = p.alibi_slopes[h], tile.from = i + p.S - p.L - js;
      tile.softcap = p.softcap;
      if (partial) tile.bits = bits + skip / 32 * kLaneRows;
      band::forward_transposed(tile, queries(b), {k.data + skip * k.ld, k.ld}, {v.data + skip * v.ld, v.ld}, E, M,
                               p.scale, scratch, w.tile.u, w.tile.m, w.tile.l);
      join_tile({a.u + b * M, a.m + b, a.l + b}, w.tile, block_rows, M);
    }
  });
  return true;
}
#endif

/// The state `a` of queries [i0, i0 + rows) of head (n, h) over the keys
/// [j_begin, j_end) (those of them each query sees), FlashAttention-2 style:
/// for each key block, one query block (forward_tiles) at a time.
/// `a` is overwritten, so it needs no initialisation.
void forward_keys(const SoftmaxAttentionParams& p, const QkReader& qk, int64_t n, int64_t h,
                  int64_t i0, int64_t rows, int64_t j_begin, int64_t j_end,
                  const ForwardScratch& w, const Accumulator& a) {
  const SubnormalsAsZero subnormals_as_zero;  // kernels/common/denormals.h says why
  // Plain names, not a structured binding: the tile lambdas below capture
  // them, which C++17 allows only for variables (clang refuses bindings).
  const ForwardTiles tiles = forward_tiles(p);
  const int64_t BQ = tiles.q, BK = tiles.k;
  const int64_t E = p.E, M = p.M;
  const Visibility visible = visibility_of(p, n);
  const Strided vh = head_matrix(p.v, p.v_stride, n, p.kv_head(h));
  const AttentionDropout dropout = dropout_of(p);

  std::fill(a.u, a.u + rows * M, 0.f);
  std::fill(a.m, a.m + rows, -kInf);
  std::fill(a.l, a.l + rows, 0.f);
  // Keys at or past a block's key_end are invisible to all its rows (causal:
  // the blocks above the diagonal; padding: past the last valid key), and so
  // are, with a window, the keys before its first row's window: skipped.
  // A tile every row sees whole needs no mask.
  const int64_t span_begin = std::max(j_begin, visible.first(i0));
  const int64_t span_end = std::min(j_end, visible(i0 + rows - 1));
  if (span_begin >= span_end) return;  // nothing visible: no need to read q
  const Rows q = qk.queries(n, h, i0, rows, w.q);
#if ATTNKIT_BAND_KERNELS
  if (by_lanes(p) && forward_by_lanes(p, qk, q, n, h, i0, rows, j_begin, j_end, w, a)) return;
#endif
  if (band_by_columns(p) && rows <= kColumnBlockQ && span_end - span_begin <= BK &&
      span_end <= std::numeric_limits<int32_t>::max())
    return forward_band_by_columns(p, qk, q, n, h, i0, rows, span_begin, span_end - span_begin, w, a);
  for_each_key_tile(p, n, h, i0, rows, span_begin, span_end, BK, [&](const KeyTile& key_tile) {
    const int64_t j0 = key_tile.j0, span_cols = key_tile.cols;
    const Rows k = qk.keys(n, h, j0, span_cols, w.k);
    const Rows v = rows_of(vh, j0, span_cols, M, w.v);
    for (int64_t b = 0; b < rows; b += BQ) {
      const int64_t block_rows = std::min(BQ, rows - b);
      const int64_t key_end = std::min(j_end, visible(i0 + b + block_rows - 1));
      if (j0 >= key_end || j0 + span_cols <= visible.first(i0 + b)) continue;
      // (Rows of one query block of a block mask: spans are its blocks.)
      if (block_kind(p, n, h, i0 + b, key_tile) == kEmptyBlock) continue;
      const int64_t cols = std::min(span_cols, key_end - j0);
      float* o = a.u + b * M;
      float* m = a.m + b;
      float* l = a.l + b;
      sgemm(false, true, block_rows, cols, E, p.scale, q.data + b * q.ld, q.ld, k.data, k.ld,
            0.f, w.s, BK);
      if (p.softcap > 0.f)
        for (int64_t r = 0; r < block_rows; ++r) vec::softcap(w.s + r * BK, cols, p.softcap);
      if (p.score_mod.active())
        for (int64_t r = 0; r < block_rows; ++r)
          score_mod::apply(p.score_mod, {n, h, i0 + b + r, j0, cols}, w.s + r * BK, w.regs, BK);
      add_score_terms(p, n, h, i0 + b, block_rows, j0, cols, w.s, BK);
      mask_tile(p, visible, n, h, i0 + b, block_rows, j0, cols, w.s, BK);

      // Online softmax: P = exp(s - m_new), l = l * exp(m - m_new) + rowsum(P),
      // and the accumulator rescaled by the same factor.
      for (int64_t r = 0; r < block_rows; ++r) {
        float* sr = w.s + r * BK;
        // max(block max, m) keeps a NaN of either: the row then stays NaN.
        const float m_new = std::max(vec::max(sr, cols), m[r]);
        if (m_new == -kInf) {  // nothing visible to this row yet: P = 0, not NaN
          std::fill(sr, sr + cols, 0.f);
          continue;
        }
        const float alpha = vec::exp(m[r] - m_new);  // 0 on the row's first visible block
        l[r] = l[r] * alpha + vec::exp_shift_sum(sr, cols, m_new);
        // Dropout after the sum: l normalises over every visible key.
        if (dropout.active()) dropout.apply(dropout.row(n, h, i0 + b + r), j0, sr, cols);
        if (alpha != 1.f) vec::scale(o + r * M, M, alpha);
        m[r] = m_new;
      }
      sgemm(false, false, block_rows, M, cols, 1.f, w.s, BK, v.data, v.ld, 1.f, o, M);
    }
  });
}

/// Writes row i of head (n, h): out_i = u / l and lse_i = m + log l. l >= 1
/// once any key was visible (the maximal term contributes exp(0)), so l == 0
/// means a row with no visible key: out = 0, lse = -inf. A NaN l (a NaN
/// score) passes through to out and lse.
void write_row(const SoftmaxAttentionParams& p, int64_t n, int64_t h, int64_t i, const float* u,
               float m, float l) {
  const int64_t* os = p.out_stride;
  float* out = p.out + n * os[0] + h * os[1] + i * os[2];
  float scale = 1.f;  // of u: exp(m - m') when a sink raises the maximum to m'
  if (p.sinks) {
    // The sink joins the row as one more term exp(sink) without a value: the
    // log-sum-exp rule as between two tiles (a NaN l stays NaN).
    const float sink = p.sinks[h];
    if (l == 0.f) {  // no visible key: only the sink, so out = 0 and lse = sink
      m = sink, l = 1.f, scale = 0.f;
    } else {
      const float top = std::max(m, sink);
      scale = vec::exp(m - top);
      l = l * scale + vec::exp(sink - top);
      m = top;
    }
  }
  const float inv = l == 0.f ? 0.f : scale / l;
  for (int64_t c = 0; c < p.M; ++c) out[c * os[3]] = u[c] * inv;
  p.lse[(n * p.H + h) * p.L + i] = l == 0.f ? -kInf : m + std::log(l);
}

/// Queries [i0, i0 + rows) of head (n, h) over all keys: out and lse.
void forward_span(const SoftmaxAttentionParams& p, const QkReader& qk, int64_t n, int64_t h,
                  int64_t i0, int64_t rows, const ForwardScratch& w) {
  forward_keys(p, qk, n, h, i0, rows, 0, p.S, w, w.acc);
  for (int64_t r = 0; r < rows; ++r)
    write_row(p, n, h, i0 + r, w.acc.u + r * p.M, w.acc.m[r], w.acc.l[r]);
}

// Splitting the keys (decoding: few queries, many keys).
//
// With fewer (n, h, query block) items than threads, most threads would idle
// however long S is. So when there are few items (under kSplitItems), each
// item's keys are cut into `chunks` chunks of `chunk` keys; each (item, chunk)
// is computed alone into its own accumulator (u_c, m_c, l_c), and a second
// loop merges them per row in chunk order:
//   m = max_c m_c,  l = sum_c e^(m_c - m) l_c,  u = sum_c e^(m_c - m) u_c,
// out = u / l, lse = m + log l: the same log-sum-exp the one sweep computes.
//
// The chunking is a function of the shape alone (N, H, L, S and the block
// sizes), never of the thread count, and the merge order is fixed, so the
// result is bitwise the same for any thread count. The split therefore aims at
// a fixed number of items, kSplitItems (four per thread up to 16 threads),
// rather than at a multiple of the threads present; on fewer threads the extra
// chunks cost one merge of a rows x M accumulator per chunk (under 1/1000 of a
// chunk's own work at chunk >= 1024 keys) and their accumulators' memory,
// at most 2 kSplitItems x kForwardBlockQ x (M + 2) floats in all.
//
// A chunk has at least kSplitMinKeys keys (four key blocks) and is a whole
// number of key blocks, so a chunk costs at least 4 x 2 (E + M) x 256 FLOPs
// per query row: at L = 1 and E = M = 64, 512 KiB of keys and values to
// stream, tens of microseconds, against an estimated microsecond or so to
// schedule one more item and merge it (estimates, not measurements; see
// docs/PERFORMANCE.md for how to time the split). Hence the threshold: the
// keys are split only when S >= 2 kSplitMinKeys = 2048 and
// N H ceil(L / kForwardBlockQ) < kSplitItems.
constexpr int64_t kSplitItems = 64;
constexpr int64_t kSplitMinKeys = 4 * kForwardBlockK;

/// Each item's keys in `chunks` chunks of `chunk` keys (the last one shorter).
struct KeySplit {
  int64_t chunk, chunks;
};

/// The split for p's shape (see above); chunks == 1: none.
KeySplit key_split(const SoftmaxAttentionParams& p) {
  const int64_t items = p.N * p.H * ceil_div(p.L, forward_tiles(p).q);
  const int64_t chunks = std::min(ceil_div(kSplitItems, items), p.S / kSplitMinKeys);
  // A block mask's work items are its query blocks, whose chunks would cut
  // its key blocks: not split.
  if (items >= kSplitItems || chunks < 2 || p.block_mask.active()) return {p.S, 1};
  // Whole key blocks; S >= 2 kSplitMinKeys keeps at least two chunks.
  const int64_t chunk = ceil_div(ceil_div(p.S, chunks), kForwardBlockK) * kForwardBlockK;
  return {chunk, ceil_div(p.S, chunk)};
}

/// The forward with the keys split: items are (head, query block, key chunk),
/// then (head, query block) merges its chunks in order.
void forward_split(const SoftmaxAttentionParams& p, const QkReader& qk, const KeySplit& split) {
  const int64_t M = p.M, BQ = forward_tiles(p).q, rows_max = std::min(p.L, BQ);
  const int64_t blocks = ceil_div(p.L, BQ), items = p.N * p.H * blocks;
  const int64_t chunks = split.chunks;
  // One accumulator per (item, chunk), laid out as in a Slicer.
  const int64_t u_size = round_up16(rows_max * M), row_size = round_up16(rows_max);
  const int64_t acc_size = u_size + 2 * row_size;
  Buffer<float> accumulators(static_cast<std::size_t>(items * chunks * acc_size));
  const auto acc_of = [&](int64_t item, int64_t c) {
    float* base = accumulators.data() + (item * chunks + c) * acc_size;
    return Accumulator{base, base + u_size, base + u_size + row_size};
  };
  // Item -> head and first query; later query blocks (more keys when causal) first.
  const auto item_rows = [&](int64_t item, int64_t& n, int64_t& h, int64_t& i0) {
    const int64_t nh = item / blocks;
    n = nh / p.H, h = nh % p.H, i0 = (blocks - 1 - item % blocks) * BQ;
    return std::min(BQ, p.L - i0);
  };

  Slicer sizer(nullptr);
  ForwardScratch(p, sizer, rows_max);  // counts the per-thread scratch
  parallel_with_scratch(sizer.used(), [&](float* base) {
    Slicer slicer(base);
    const ForwardScratch w(p, slicer, rows_max);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < items * chunks; ++t) {
      int64_t n, h, i0;
      const int64_t item = t / chunks, c = t % chunks, rows = item_rows(item, n, h, i0);
      const int64_t j_begin = c * split.chunk, j_end = std::min(p.S, j_begin + split.chunk);
      forward_keys(p, qk, n, h, i0, rows, j_begin, j_end, w, acc_of(item, c));
    }
    // (the implicit barrier: every chunk is done before any merge reads it)
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      int64_t n, h, i0;
      const int64_t rows = item_rows(item, n, h, i0);
      float* u = w.acc.u;  // the merged row
      for (int64_t r = 0; r < rows; ++r) {
        // The largest m_c; NaN if any m_c is NaN (a NaN score), which makes
        // every weight, so l and the row, NaN as in the single sweep.
        float m = -kInf;
        for (int64_t c = 0; c < chunks; ++c) {
          const float mc = acc_of(item, c).m[r];
          if (mc > m || std::isnan(mc)) m = mc;
          if (std::isnan(m)) break;
        }
        float l = 0.f;
        std::fill(u, u + M, 0.f);
        for (int64_t c = 0; c < chunks; ++c) {
          const Accumulator a = acc_of(item, c);
          if (a.m[r] == -kInf) continue;  // no visible key in the chunk: u_c = 0, l_c = 0
          const float weight = vec::exp(a.m[r] - m);
          l += weight * a.l[r];
          vec::axpy(u, weight, a.u + r * M, M);
        }
        write_row(p, n, h, i0 + r, u, m, l);
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Backward
//
// Per tile of queries [i0, i0 + rows) x keys [j0, j0 + cols), with P
// recomputed from lse and D_i = rowsum(dO_i * O_i):
//   dP = dO V^T,  dS = P * (dP - D)  (the gradient of the scores, = dBias);
//   dV += P^T dO,  dK += scale dS^T Q,  dQ += scale dS K.
// ---------------------------------------------------------------------------

/// The inputs of one tile: q and dout at its first query, k and v at its first
/// key, lse and D at its first query.
/// A score modifier's scratch in the backward: its two register files
/// (score_mod_floats each) and a tile of the scores it was given.
struct ScoreModScratch {
  float *regs = nullptr, *adj = nullptr, *raw = nullptr;
};

/// One register file of the backward's score modifier over a key tile.
int64_t score_mod_floats(const SoftmaxAttentionParams& p) {
  return p.score_mod.active() ? score_mod::scratch_floats(p.score_mod.size, kBackwardBlockK) : 0;
}

struct TileInputs {
  Rows q, dout, k, v;
  const float *lse, *d;
};

/// prob = P and ds = dS of the tile (rows x cols, row stride kBackwardBlockK),
/// dS the gradient of the scores after soft-capping (what the bias adds to);
/// with soft-capping, softcap_slope (when given, the same layout) gets each
/// score's 1 - tanh^2, which takes dS back through the cap (softcap_back);
/// with dropout prob = P o Z / (1 - p), what multiplies v (and dv's factor),
/// and ds = P o (dP - D) with dP = (dO V^T) o Z / (1 - p).
/// With a score modifier, its registers are in mod.regs, and mod.raw (when
/// given, the tile's layout) keeps the scores it was given (score_mod_back).
void tile_scores_grad(const SoftmaxAttentionParams& p, int64_t n, int64_t h,
                      const Visibility& visible, int64_t i0, int64_t rows, int64_t j0, int64_t cols,
                      const TileInputs& x, float* prob, float* ds, float* softcap_slope = nullptr,
                      const ScoreModScratch& mod = {}) {
  const int64_t BK = kBackwardBlockK;
  sgemm(false, true, rows, cols, p.E, p.scale, x.q.data, x.q.ld, x.k.data, x.k.ld, 0.f, prob, BK);
  if (p.softcap > 0.f)
    for (int64_t r = 0; r < rows; ++r)
      vec::softcap(prob + r * BK, cols, p.softcap, softcap_slope ? softcap_slope + r * BK : nullptr);
  if (p.score_mod.active())
    for (int64_t r = 0; r < rows; ++r) {
      float* s = prob + r * BK;
      if (mod.raw) std::copy(s, s + cols, mod.raw + r * BK);
      score_mod::apply(p.score_mod, {n, h, i0 + r, j0, cols}, s, mod.regs, BK);
    }
  add_score_terms(p, n, h, i0, rows, j0, cols, prob, BK);
  mask_tile(p, visible, n, h, i0, rows, j0, cols, prob, BK);
  for (int64_t r = 0; r < rows; ++r) {
    float* pr = prob + r * BK;
    if (x.lse[r] == -kInf)  // a row with no visible key: P = 0, not NaN
      std::fill(pr, pr + cols, 0.f);
    else
      vec::exp_shift(pr, cols, x.lse[r]);
  }
  sgemm(false, true, rows, cols, p.M, 1.f, x.dout.data, x.dout.ld, x.v.data, x.v.ld, 0.f, ds, BK);
  const AttentionDropout dropout = dropout_of(p);
  if (!dropout.active()) {
    for (int64_t r = 0; r < rows; ++r) vec::softmax_grad(ds + r * BK, prob + r * BK, cols, x.d[r]);
    return;
  }
  uint16_t keep[AttentionDropout::kMaxKeys / 16];
  for (int64_t r = 0; r < rows; ++r) {
    dropout.keep_bits(dropout.row(n, h, i0 + r), j0, cols, keep);
    AttentionDropout::scale_kept(ds + r * BK, cols, keep, dropout.scale());
    vec::softmax_grad(ds + r * BK, prob + r * BK, cols, x.d[r]);
    AttentionDropout::scale_kept(prob + r * BK, cols, keep, dropout.scale());
  }
}

/// d[r] = D_i = dout_i . out_i (- dlse_i when given) for the rows [i0, i0 +
/// rows) of head (n, h), given those rows of dout.
void row_deltas(const SoftmaxAttentionBackwardParams& p, int64_t n, int64_t h, const Rows& dout, int64_t i0,
                int64_t rows, float* d) {
  const Strided out = head_matrix(p.out, p.out_stride, n, h);
  for (int64_t r = 0; r < rows; ++r) {
    const float* oi = out.row(i0 + r);
    const float* gi = dout.row(r);
    if (out.cs == 1) {
      d[r] = vec::dot(gi, oi, p.M);
    } else {
      float sum = 0.f;
      for (int64_t c = 0; c < p.M; ++c) sum += gi[c] * oi[c * out.cs];
      d[r] = sum;
    }
  }
  if (p.dlse) {
    const float* dlse = p.dlse + (n * p.H + h) * p.L + i0;
    for (int64_t r = 0; r < rows; ++r) d[r] -= dlse[r];
  }
}

/// Where dbias keeps the entries of head (n, h): its (Lb, Sb) slice.
struct BiasGrad {
  float* slice = nullptr;
  int64_t Lb = 0, Sb = 0;

  BiasGrad() = default;
  BiasGrad(const SoftmaxAttentionBackwardParams& p, int64_t n, int64_t h)
      : Lb(p.dbias_shape[2]), Sb(p.dbias_shape[3]) {
    const int64_t nb = p.dbias_shape[0] == 1 ? 0 : n, hb = p.dbias_shape[1] == 1 ? 0 : h;
    slice = p.dbias + (nb * p.dbias_shape[1] + hb) * Lb * Sb;
  }
  float* row(int64_t i) const { return slice + (Lb == 1 ? 0 : i) * Sb; }

  /// Adds the tile's dS (row stride ld) into the slice, summing over L or S
  /// when the slice does; rows in order, and keys in order within a row.
  void add(int64_t i0, int64_t rows, int64_t j0, int64_t cols, const float* ds, int64_t ld) const {
    for (int64_t r = 0; r < rows; ++r) {
      float* b = row(i0 + r);
      if (Sb == 1) {
        float sum = *b;
        for (int64_t c = 0; c < cols; ++c) sum += ds[r * ld + c];
        *b = sum;
      } else {
        vec::add(b + j0, ds + r * ld, cols);
      }
    }
  }
};

/// Whether every head has a dbias slice of its own (then it is written inline).
bool bias_grad_per_head(const SoftmaxAttentionBackwardParams& p) {
  return p.dbias_shape[0] == p.N && p.dbias_shape[1] == p.H;
}

/// The backward's work items: each (batch, head) in `parts` runs of whole key
/// blocks. A part owns the dK, dV rows of its keys and adds its share of dQ
/// into a dQ of its own; parts > 1 sum those in part order afterwards. The
/// parts depend on the shape alone, so the result does not depend on the
/// thread count.
///
/// Enough parts for kMinSplitItems threads when N H is small, so that
/// N H = 1 uses every core; one when N H is large, since each extra part
/// costs an L x E dQ buffer and its sum. A dbias slice of the head's own that
/// sums over the keys (Sb = 1) would be shared by the parts: then one part.
/// The unit of the backward's key parts: its key tile, or a block mask's key block.
int64_t part_unit(const SoftmaxAttentionBackwardParams& p) {
  return p.block_mask.active() ? p.block_mask.kv_block : kBackwardBlockK;
}

int64_t backward_parts(const SoftmaxAttentionBackwardParams& p) {
  if (p.dbias) return 1;
  const int64_t parts = ceil_div(kMinSplitItems, p.N * p.H);
  return std::max<int64_t>(1, std::min(parts, ceil_div(p.S, part_unit(p))));
}

/// The keys [j_begin, j_end) of part `part` of `parts`: whole units (part_unit).
std::pair<int64_t, int64_t> part_keys(const SoftmaxAttentionBackwardParams& p, int64_t parts,
                                      int64_t part) {
  const int64_t unit = part_unit(p), blocks = ceil_div(p.S, unit);
  return {std::min(p.S, part * blocks / parts * unit), std::min(p.S, (part + 1) * blocks / parts * unit)};
}

/// The backward reads a whole head of q, k, v and dout once per key or query
/// block: each is copied into the scratch unless its rows are adjacent
/// (compact_rows_of), so that rows H E floats apart (attention over an (N, L,
/// H, E) projection viewed as (N, H, L, E), or a packed batch) are not read
/// at that stride again and again (docs/PERFORMANCE.md, "Packed
/// variable-length batches", gives what was measured).
struct BackwardScratch {
  float *q, *k, *v, *dout;  // compact copies of the head unless its rows are adjacent
  float *d;                 // D_i = rowsum(dO_i * O_i): L
  float *dq;                // dQ accumulator of the head: L x E (one part per head)
  float *dk, *dv;           // dK, dV accumulators of one key block
  float *prob, *ds;         // P and dS: kBackwardBlockQ x kBackwardBlockK
  float *slope;             // soft-capping's 1 - tanh^2, the same size (none without it)
  ScoreModScratch mod;      // a score modifier's (none without it)

  BackwardScratch(const SoftmaxAttentionBackwardParams& p, const QkReader& qk, Slicer& slicer)
      : q(slicer.take(qk.rotates() || needs_compact({p.q, p.q_stride[2], p.q_stride[3]}, p.L, p.E) ? p.L * p.E
                                                                                                     : 0)),
        k(slicer.take(qk.rotates() || needs_compact({p.k, p.k_stride[2], p.k_stride[3]}, p.S, p.E) ? p.S * p.E
                                                                                                     : 0)),
        v(slicer.take(needs_compact({p.v, p.v_stride[2], p.v_stride[3]}, p.S, p.M) ? p.S * p.M : 0)),
        dout(slicer.take(
            needs_compact({p.dout, p.dout_stride[2], p.dout_stride[3]}, p.L, p.M) ? p.L * p.M : 0)),
        d(slicer.take(p.L)),
        dq(slicer.take(backward_parts(p) == 1 ? p.L * p.E : 0)),
        dk(slicer.take(kBackwardBlockK * p.E)),
        dv(slicer.take(kBackwardBlockK * p.M)),
        prob(slicer.take(kBackwardBlockQ * kBackwardBlockK)),
        ds(slicer.take(kBackwardBlockQ * kBackwardBlockK)),
        slope(slicer.take(p.softcap > 0.f ? kBackwardBlockQ * kBackwardBlockK : 0)),
        mod{slicer.take(score_mod_floats(p)), slicer.take(score_mod_floats(p)),
            slicer.take(p.score_mod.active() ? kBackwardBlockQ * kBackwardBlockK : 0)} {}
};

/// ds *= slope over a tile's rows x cols (row stride kBackwardBlockK): the
/// gradient of the scores before soft-capping from the one after it.
void softcap_back(float* ds, const float* slope, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    float* d = ds + r * kBackwardBlockK;
    const float* s = slope + r * kBackwardBlockK;
    for (int64_t c = 0; c < cols; ++c) d[c] *= s[c];
  }
}

/// Calls f(i0, rows) for the backward's query tiles of the key tile from j0
/// (inside one key block of a block mask) over the queries [begin, end) of
/// head (n, h): tiles of kBackwardBlockQ rows from the one holding `begin`,
/// or with a block mask, of up to kBackwardBlockQ rows inside each query block
/// whose block at j0 is not empty.
template <class F>
void for_each_query_tile(const SoftmaxAttentionParams& p, int64_t n, int64_t h, int64_t j0, int64_t begin, int64_t end,
                         const F& f) {
  const int64_t BQ = kBackwardBlockQ;
  const BlockMaskView& mask = p.block_mask;
  if (!mask.active()) {
    for (int64_t i0 = begin / BQ * BQ; i0 < end; i0 += BQ) f(i0, std::min(BQ, p.L - i0));
    return;
  }
  const int64_t kb = j0 / mask.kv_block;
  for (int64_t qb = begin / mask.q_block; qb * mask.q_block < end; ++qb) {
    if (mask.kind(n, h, qb, kb) == kEmptyBlock) continue;
    const int64_t last = std::min(p.L, (qb + 1) * mask.q_block);
    for (int64_t i0 = qb * mask.q_block; i0 < last; i0 += BQ)
      if (i0 + BQ > begin) f(i0, std::min(BQ, last - i0));
  }
}

/// dk, dv of the keys [j_begin, j_end) of head (n, h), these keys' terms of dq
/// added into `dq` (L x E, zeroed by the caller), and the head's dbias slice
/// when it has its own (then the keys are [0, S): one part). Key blocks outer
/// (each owns its dK, dV rows), query blocks inner.
void backward_keys(const SoftmaxAttentionBackwardParams& p, const QkReader& qk, int64_t n,
                   int64_t h, int64_t j_begin, int64_t j_end, float* dq, float* dtables,
                   const BackwardScratch& w) {
  const SubnormalsAsZero subnormals_as_zero;  // as in the forward
  const int64_t L = p.L, S = p.S, E = p.E, M = p.M;
  const int64_t BK = kBackwardBlockK;
  const Visibility visible = visibility_of(p, n);
  const Rows q = qk.queries(n, h, 0, L, w.q, /*compact=*/true);
  const Rows k = qk.keys(n, h, 0, S, w.k, /*compact=*/true);
  const Rows v = compact_rows_of(head_matrix(p.v, p.v_stride, n, p.kv_head(h)), 0, S, M, w.v);
  const Rows dout = compact_rows_of(head_matrix(p.dout, p.dout_stride, n, h), 0, L, M, w.dout);
  const float* lse = p.lse + (n * p.H + h) * L;
  row_deltas(p, n, h, dout, 0, L, w.d);
  const bool dbias = p.dbias && bias_grad_per_head(p);
  const BiasGrad bias_grad = dbias ? BiasGrad(p, n, h) : BiasGrad();
  if (dbias) std::fill(bias_grad.slice, bias_grad.slice + bias_grad.Lb * bias_grad.Sb, 0.f);

  // Keys at or past key_end are invisible to every query: zero gradients.
  const int64_t key_end = std::max(j_begin, std::min(j_end, visible(L - 1)));
  // Key tiles of BK keys, or with a block mask each key block's (part_keys
  // starts parts at a block).
  const int64_t key_block = p.block_mask.active() ? p.block_mask.kv_block : key_end - j_begin;
  for (int64_t j0 = j_begin; j0 < key_end;) {
    const int64_t block_end = std::min(key_end, j_begin + ((j0 - j_begin) / key_block + 1) * key_block);
    const int64_t cols = std::min(BK, block_end - j0);
    std::fill(w.dk, w.dk + cols * E, 0.f);
    std::fill(w.dv, w.dv + cols * M, 0.f);
    // Causal: queries before the first that sees key j0 see none of these
    // keys; start at the query block holding it. With a window, queries from
    // the end of the last key's window on see none either.
    const int64_t query_begin = visible.first_query(j0, L);
    const int64_t query_end = std::min(L, visible.end_query(j0 + cols - 1, L));
    for_each_query_tile(p, n, h, j0, query_begin, query_end, [&](int64_t i0, int64_t rows) {
      const TileInputs x{{q.row(i0), q.ld}, {dout.row(i0), dout.ld}, {k.row(j0), k.ld},
                         {v.row(j0), v.ld}, lse + i0,                w.d + i0};
      tile_scores_grad(p, n, h, visible, i0, rows, j0, cols, x, w.prob, w.ds, w.slope, w.mod);
      if (dbias) bias_grad.add(i0, rows, j0, cols, w.ds, BK);
      if (p.score_mod.active())
        for (int64_t r = 0; r < rows; ++r)
          score_mod::backward(p.score_mod, {n, h, i0 + r, j0, cols}, w.mod.raw + r * BK, w.ds + r * BK,
                              w.mod.regs, w.mod.adj, BK, dtables);
      if (p.softcap > 0.f) softcap_back(w.ds, w.slope, rows, cols);
      sgemm(true, false, cols, M, rows, 1.f, w.prob, BK, x.dout.data, x.dout.ld, 1.f, w.dv, M);
      sgemm(true, false, cols, E, rows, p.scale, w.ds, BK, x.q.data, x.q.ld, 1.f, w.dk, E);
      sgemm(false, false, rows, E, cols, p.scale, w.ds, BK, x.k.data, x.k.ld, 1.f, dq + i0 * E,
            E);
    });
    qk.unrotate_keys(w.dk, j0, cols);
    store(w.dk, cols, E, head_of(p.dk, p.dk_stride, n, h) + j0 * p.dk_stride[2], p.dk_stride[2],
          p.dk_stride[3]);
    store(w.dv, cols, M, head_of(p.dv, p.dv_stride, n, h) + j0 * p.dv_stride[2], p.dv_stride[2],
          p.dv_stride[3]);
    j0 += cols;
  }
  store_zeros(j_end - key_end, E, head_of(p.dk, p.dk_stride, n, h) + key_end * p.dk_stride[2],
              p.dk_stride[2], p.dk_stride[3]);
  store_zeros(j_end - key_end, M, head_of(p.dv, p.dv_stride, n, h) + key_end * p.dv_stride[2],
              p.dv_stride[2], p.dv_stride[3]);
}

// ---------------------------------------------------------------------------
// Bias gradient shared by several heads
// ---------------------------------------------------------------------------

struct BiasScratch {
  float *q, *dout, *k, *v;  // packed blocks when the strides need it
  float *d;                 // D of a query block
  float *prob, *ds;         // kBackwardBlockQ x kBackwardBlockK
  ScoreModScratch mod;      // a score modifier's registers (its raw scores are not needed here)

  BiasScratch(const SoftmaxAttentionBackwardParams& p, Slicer& slicer)
      : q(slicer.take(kBackwardBlockQ * p.E)),
        dout(slicer.take(kBackwardBlockQ * p.M)),
        k(slicer.take(kBackwardBlockK * p.E)),
        v(slicer.take(kBackwardBlockK * p.M)),
        d(slicer.take(kBackwardBlockQ)),
        prob(slicer.take(kBackwardBlockQ * kBackwardBlockK)),
        ds(slicer.take(kBackwardBlockQ * kBackwardBlockK)),
        mod{slicer.take(score_mod_floats(p))} {}
};

/// The part of dbias one work item owns: slice (nb, hb), queries [i_begin,
/// i_end) and keys [j_begin, j_end) (all of them along a summed dimension).
struct BiasPart {
  int64_t nb, hb, i_begin, i_end, j_begin, j_end;
};

/// The dbias entries of `part`, summed over the heads of its slice in
/// increasing (n, h) order, each head's tiles in a fixed order.
void bias_part_grad(const SoftmaxAttentionBackwardParams& p, const QkReader& qk,
                    const BiasPart& part, const BiasScratch& w) {
  const int64_t BQ = kBackwardBlockQ, BK = kBackwardBlockK;
  const int64_t Nb = p.dbias_shape[0], Hb = p.dbias_shape[1];
  const BiasGrad first(p, part.nb, part.hb);
  for (int64_t i = part.i_begin; i < (first.Lb == 1 ? part.i_begin + 1 : part.i_end); ++i)
    if (first.Sb == 1)
      *first.row(i) = 0.f;
    else
      std::fill(first.row(i) + part.j_begin, first.row(i) + part.j_end, 0.f);

  for (int64_t n = Nb == 1 ? 0 : part.nb; n < (Nb == 1 ? p.N : part.nb + 1); ++n) {
    const Visibility visible = visibility_of(p, n);
    for (int64_t h = Hb == 1 ? 0 : part.hb; h < (Hb == 1 ? p.H : part.hb + 1); ++h) {
      const Strided v = head_matrix(p.v, p.v_stride, n, p.kv_head(h));
      const Strided dout = head_matrix(p.dout, p.dout_stride, n, h);
      const float* lse = p.lse + (n * p.H + h) * p.L;
      for (int64_t i0 = part.i_begin; i0 < part.i_end; i0 += BQ) {
        const int64_t rows = std::min(BQ, part.i_end - i0);
        const int64_t j_end = std::min(part.j_end, visible(i0 + rows - 1));
        if (j_end <= part.j_begin) continue;
        TileInputs x{qk.queries(n, h, i0, rows, w.q), rows_of(dout, i0, rows, p.M, w.dout),
                     {}, {}, lse + i0, w.d};
        row_deltas(p, n, h, x.dout, i0, rows, w.d);
        for (int64_t j0 = part.j_begin; j0 < j_end; j0 += BK) {
          const int64_t cols = std::min(BK, j_end - j0);
          if (j0 + cols <= visible.first(i0)) continue;  // before every row's window
          x.k = qk.keys(n, h, j0, cols, w.k);
          x.v = rows_of(v, j0, cols, p.M, w.v);
          tile_scores_grad(p, n, h, visible, i0, rows, j0, cols, x, w.prob, w.ds, nullptr, w.mod);
          first.add(i0, rows, j0, cols, w.ds, BK);
        }
      }
    }
  }
}

/// dbias when heads share slices: items own disjoint parts (see the header).
void shared_bias_grad(const SoftmaxAttentionBackwardParams& p, const QkReader& qk) {
  const int64_t Lb = p.dbias_shape[2], Sb = p.dbias_shape[3];
  const int64_t slices = p.dbias_shape[0] * p.dbias_shape[1];
  const int64_t query_parts = Lb == 1 ? 1 : ceil_div(p.L, kBackwardBlockQ);
  const int64_t key_parts = Sb == 1 ? 1 : ceil_div(p.S, kBackwardBlockK);
  parallel_for_scratch(
      slices * query_parts * key_parts, [&](Slicer& s) { return BiasScratch(p, s); },
      [&](int64_t t, const BiasScratch& w) {
        const int64_t slice = t / (query_parts * key_parts), qp = t / key_parts % query_parts,
                      kp = t % key_parts;
        BiasPart part{slice / p.dbias_shape[1], slice % p.dbias_shape[1], 0, p.L, 0, p.S};
        if (Lb != 1)
          part.i_begin = qp * kBackwardBlockQ, part.i_end = std::min(p.L, part.i_begin + kBackwardBlockQ);
        if (Sb != 1)
          part.j_begin = kp * kBackwardBlockK, part.j_end = std::min(p.S, part.j_begin + kBackwardBlockK);
        bias_part_grad(p, qk, part, w);
      });
}

// ---------------------------------------------------------------------------
// A score modifier's captured tensors' gradient
// ---------------------------------------------------------------------------

/// One gradient buffer of the flat tables per backward work item, each
/// item's share summed by itself in its fixed order, then the items in
/// order: the same bits on any thread count (the items depend on the shape
/// alone). Empty when the gradient is not asked for.
class TableGrads {
 public:
  TableGrads(const SoftmaxAttentionBackwardParams& p, int64_t items)
      : numel_(p.dscore_tables && p.score_mod.active() ? p.score_mod.tables_numel : 0),
        items_(numel_ > 0 ? items : 0),
        buffer_(static_cast<std::size_t>(items_ * numel_)) {
    std::fill(buffer_.data(), buffer_.data() + items_ * numel_, 0.f);
  }

  /// Item t's buffer, nullptr when none is kept.
  float* item(int64_t t) const { return numel_ > 0 ? buffer_.data() + t * numel_ : nullptr; }

  /// out (numel) = the items' sum; nothing when out is nullptr.
  void sum_into(float* out) const {
    if (!out) return;
    std::fill(out, out + numel_, 0.f);
    for (int64_t t = 0; t < items_; ++t) vec::add(out, item(t), numel_);
  }

 private:
  int64_t numel_, items_;
  mutable Buffer<float> buffer_;
};

// ---------------------------------------------------------------------------
// Attention sinks' gradient
// ---------------------------------------------------------------------------

struct SinkScratch {
  float *dout, *d;  // a block of dout rows (packed when the strides need it), its D

  SinkScratch(const SoftmaxAttentionBackwardParams& p, Slicer& slicer)
      : dout(slicer.take(kBackwardBlockQ * p.M)), d(slicer.take(kBackwardBlockQ)) {}
};

/// p.dsinks: d sink_h = -sum_(n, i) exp(sink_h - lse_i) D_i, each (n, h)
/// summed by one item in row order, then the batch in order.
void sink_grads(const SoftmaxAttentionBackwardParams& p) {
  Buffer<float> per_head(static_cast<std::size_t>(p.N * p.H));
  parallel_for_scratch(
      p.N * p.H, [&](Slicer& s) { return SinkScratch(p, s); },
      [&](int64_t nh, const SinkScratch& w) {
        const int64_t n = nh / p.H, h = nh % p.H;
        const Strided dout = head_matrix(p.dout, p.dout_stride, n, h);
        const float* lse = p.lse + nh * p.L;
        double sum = 0.0;
        for (int64_t i0 = 0; i0 < p.L; i0 += kBackwardBlockQ) {
          const int64_t rows = std::min(kBackwardBlockQ, p.L - i0);
          row_deltas(p, n, h, rows_of(dout, i0, rows, p.M, w.dout), i0, rows, w.d);
          for (int64_t r = 0; r < rows; ++r) sum += std::exp(static_cast<double>(p.sinks[h]) - lse[i0 + r]) * w.d[r];
        }
        per_head[nh] = static_cast<float>(-sum);
      });
  for (int64_t h = 0; h < p.H; ++h) {
    float total = 0.f;
    for (int64_t n = 0; n < p.N; ++n) total += per_head[n * p.H + h];
    p.dsinks[h] = total;
  }
}

}  // namespace

/// Decoding with grouped-query heads: one query (L = 1) per head, and the
/// heads of a group share their keys and values. Attended head by head, each
/// key/value head's cache would be streamed once per query head of its group.
/// Seen as attention of Hkv heads whose G = H / Hkv query *rows* are the
/// group's heads (row r of head g: query head g G + r), one product reads the
/// cache once per group. The rows' layout lines up: q, out and lse of query
/// head g G + r sit at head stride times (g G + r), and lse's (n, h) index
/// n H + g G + r is (n Hkv + g) G + r. Taken when nothing about a row depends
/// on its query head or position beyond q itself: no bias, ALiBi, rotary
/// positions, window or dropout (whose mask is drawn per head); the causal
/// mask of a single query over S keys hides nothing, so it is dropped.
/// Returns false when p is not such a call.
bool as_grouped_rows(const SoftmaxAttentionParams& p, SoftmaxAttentionParams& rows) {
  if (p.L != 1 || p.kv_group <= 1 || p.bias || p.alibi_slopes || p.rotary_dim > 0 || p.window > 0 ||
      p.dropout_p > 0 || p.block_mask.active() || p.sinks || p.score_mod.active())
    return false;
  const int64_t G = p.kv_group;
  rows = p;
  rows.H = p.H / G, rows.L = G, rows.kv_group = 1, rows.causal = false;
  rows.q_stride[2] = p.q_stride[1], rows.q_stride[1] = G * p.q_stride[1];
  rows.out_stride[2] = p.out_stride[1], rows.out_stride[1] = G * p.out_stride[1];
  return true;
}

void softmax_attention_forward(const SoftmaxAttentionParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return;
  // (Qualified: the dispatching declaration of the same name is visible here too.)
  if (SoftmaxAttentionParams rows; as_grouped_rows(p, rows))
    return ATTNKIT_ISA_NAMESPACE::softmax_attention_forward(rows);
  const QkReader qk(p);
  const KeySplit split = key_split(p);
  if (split.chunks > 1) return forward_split(p, qk, split);
  // Fewer blocks per span when there would be under 4 spans per thread to
  // balance. How rows are grouped into spans does not change any result.
  // With a block mask, spans are made of its query blocks. The lane tiles
  // may group them (each lane block then finds its own kind of each key
  // block), when no lane block crosses two; the sgemm tiles take one.
  const bool masked = p.block_mask.active();
  const int64_t heads = p.N * p.H;
  const int64_t BQ = masked ? p.block_mask.q_block : forward_tiles(p).q, blocks = ceil_div(p.L, BQ);
  // With a window each query block reads its own band of keys, from its first
  // row's window on: spans of one block, whatever the thread count (the key
  // tiles then start where the band does, so grouping would change them).
  // A block mask's tiles start where its blocks do, window or not.
  int64_t group = p.window > 0 && !masked ? 1 : kForwardGroup;
  if (masked && !(by_lanes(p) && BQ % kLaneRows == 0)) group = 1;
  while (group > 1 && heads * ceil_div(blocks, group) < 4 * num_threads()) group /= 2;
  const int64_t span = group * BQ, spans = ceil_div(p.L, span);
  // Consecutive items share a head, so its keys and values stay in cache.
  // Within a head the last spans come first: with causal masking they see
  // the most keys, and the dynamic schedule balances best longest-first.
  parallel_for_scratch(
      spans * heads,
      [&](Slicer& s) { return ForwardScratch(p, s, group * BQ); },
      [&](int64_t t, const ForwardScratch& w) {
        const int64_t nh = t / spans, i0 = (spans - 1 - t % spans) * span;
        forward_span(p, qk, nh / p.H, nh % p.H, i0, std::min(span, p.L - i0), w);
      });
}

int64_t softmax_attention_forward_key_chunks(const SoftmaxAttentionParams& p) {
  if (p.N == 0 || p.H == 0 || p.L == 0) return 1;
  if (SoftmaxAttentionParams rows; as_grouped_rows(p, rows)) return key_split(rows).chunks;
  return key_split(p).chunks;
}

void softmax_attention_backward(const SoftmaxAttentionBackwardParams& p) {
  if (p.sinks && p.dsinks) {
    std::fill(p.dsinks, p.dsinks + p.H, 0.f);
    if (p.N > 0 && p.L > 0) sink_grads(p);
  }
  if (p.dscore_tables && p.score_mod.active())  // an empty problem's gradient; otherwise overwritten below
    std::fill(p.dscore_tables, p.dscore_tables + p.score_mod.tables_numel, 0.f);
  if (p.N == 0 || p.H == 0) {
    if (p.dbias) {  // an empty batch contributes nothing to a bias that is not empty
      const int64_t* b = p.dbias_shape;
      std::fill(p.dbias, p.dbias + b[0] * b[1] * b[2] * b[3], 0.f);
    }
    return;
  }
  const QkReader qk(p);
  const int64_t parts = backward_parts(p), L = p.L, E = p.E;
  const TableGrads table_grads(p, p.N * p.H * parts);
  if (parts == 1) {
    parallel_for_scratch(
        p.N * p.H, [&](Slicer& s) { return BackwardScratch(p, qk, s); },
        [&](int64_t nh, const BackwardScratch& w) {
          const int64_t n = nh / p.H, h = nh % p.H;
          std::fill(w.dq, w.dq + L * E, 0.f);
          backward_keys(p, qk, n, h, 0, p.S, w.dq, table_grads.item(nh), w);
          qk.unrotate_queries(w.dq, 0, L);
          store(w.dq, L, E, head_of(p.dq, p.dq_stride, n, h), p.dq_stride[2], p.dq_stride[3]);
        });
    if (p.dbias && !bias_grad_per_head(p)) shared_bias_grad(p, qk);
    table_grads.sum_into(p.dscore_tables);
    return;
  }
  // Parts of heads, then each head's dQ summed over its parts in order, per
  // block of query rows.
  Buffer<float> dq_parts(static_cast<std::size_t>(p.N * p.H * parts * L * E));
  parallel_for_scratch(
      p.N * p.H * parts, [&](Slicer& s) { return BackwardScratch(p, qk, s); },
      [&](int64_t t, const BackwardScratch& w) {
        const int64_t nh = t / parts, part = t % parts;
        float* dq = dq_parts.data() + t * L * E;
        std::fill(dq, dq + L * E, 0.f);
        const auto [j_begin, j_end] = part_keys(p, parts, part);
        backward_keys(p, qk, nh / p.H, nh % p.H, j_begin, j_end, dq, table_grads.item(t), w);
      });
  table_grads.sum_into(p.dscore_tables);
  const int64_t blocks = ceil_div(L, kBackwardBlockQ);
  parallel_for(p.N * p.H * blocks, 0, [&](int64_t t, float*) {
    const int64_t nh = t / blocks, i0 = t % blocks * kBackwardBlockQ;
    const int64_t rows = std::min(kBackwardBlockQ, L - i0);
    float* sum = dq_parts.data() + nh * parts * L * E + i0 * E;  // part 0's rows take the sum
    for (int64_t part = 1; part < parts; ++part)
      vec::add(sum, dq_parts.data() + (nh * parts + part) * L * E + i0 * E, rows * E);
    qk.unrotate_queries(sum, i0, rows);
    store(sum, rows, E, head_of(p.dq, p.dq_stride, nh / p.H, nh % p.H) + i0 * p.dq_stride[2],
          p.dq_stride[2], p.dq_stride[3]);
  });
}

ATTNKIT_KERNELS_END
