"""C++ generation: wraps lowered loop nests into a self-contained translation unit.

The unit includes only the C++ standard library (no PyTorch headers, so it builds in
a fraction of a second) and exports ``extern "C"`` entry points over raw pointers:

``int sn_run(void* const* arrays, const int64_t* dims, int nthreads, void** handle)``
    computes the expression. ``arrays`` holds each slot's arrays (see
    :func:`slot_arrays`) followed, for a dense output, by the zero-initialised output.
    For a sparse output, ``*handle`` receives per-chunk level buffers, or, for a
    two-phase output (see assemble), the output's ``pos``; it then keeps ``arrays`` and
    ``dims``, which must stay valid until ``sn_finish``.
Kernels with a sparse (non-sampled) output also export:

``void sn_sizes(void* handle, int64_t* sizes)``
    per output level: stored coordinates and counts; then the number of values.
``int sn_finish(void* handle, void* const* arrays, int wide, int nthreads)``
    writes pos/crd (int32, or int64 when ``wide``) and values into caller-owned arrays
    (prefix sums of the per-parent counts, or the second phase) and frees the handle.
``void sn_free(void* handle)``

Errors (allocation failure) are returned as non-zero codes, never thrown across the
C boundary.
"""

from __future__ import annotations

from ..lower.kernel import LoweredKernel, Slot

__all__ = ["generate_source", "slot_arrays"]

_CTYPES = {"float32": "float", "float64": "double", "int32": "int32_t", "int64": "int64_t"}
_ITEMSIZE = {"float32": 4, "float64": 8, "int32": 4, "int64": 8}
_LANE_INTS = {"float32": "int32_t", "float64": "int64_t"}  # shuffle index lanes

_PRELUDE = r"""
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

typedef @V@ V;
typedef @I@ I;

/* SIMD vectors of V for register-blocked loops (GCC/Clang vector extensions). */
typedef V VV __attribute__((vector_size(@VECTOR_BYTES@)));
constexpr int SN_W = (int)(sizeof(VV) / sizeof(V));
static inline VV sn_load(const V* p) { VV v; std::memcpy(&v, p, sizeof v); return v; }
static inline void sn_store(V* p, VV v) { std::memcpy(p, &v, sizeof v); }
/* Lanes of a and b picked by constant indices (b's lanes numbered from SN_W). */
typedef @IV@ VI __attribute__((vector_size(@VECTOR_BYTES@)));
#if defined(__clang__)
#define SN_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SN_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (VI){__VA_ARGS__})
#endif
@HSUMS@
/* Prefetch n bytes from p, a cache line (64 bytes) at a time, into L2 (prefetcht1):
   the L1's few miss buffers would cap the lines in flight (gathers 1.2-1.8x faster). */
static inline void sn_prefetch(const V* p, int64_t n) {
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch((const char*)p + b, 0, 2);
}

/* First coordinate r in [0, n] with pos[r] + r >= target (pos is non-decreasing). */
template <class J>
static inline int64_t sn_balanced_bound(const J* pos, int64_t n, int64_t target) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if ((int64_t)pos[mid] + mid < target) lo = mid + 1; else hi = mid;
  }
  return lo;
}

"""

# Only kernels that assemble a sparse output need these (they double the build time).
_SPARSE_OUTPUT_PRELUDE = r"""
#include <climits>
#include <memory>
#include <utility>
#include <vector>

static inline void sn_fail(int& flag) {
#pragma omp atomic write
  flag = 1;
}

/* Output levels appended by one chunk of the outermost loop: per compressed level its
   coordinates and, per parent position, how many children it got. */
struct Chunk {
  std::vector<std::vector<int64_t>> cnt;
  std::vector<std::vector<I>> crd;
  std::vector<V> val;
  void init(int rank) { cnt.assign(rank, {}); crd.assign(rank, {}); val.clear(); }
};

struct Result {
  int rank, num_dense;
  std::vector<Chunk> chunks;
  /* Two-phase: pos of the one compressed level, and sn_run's arguments for phase 2. */
  std::vector<int64_t> pos;
  void* const* arrays = nullptr;
  const int64_t* dims = nullptr;
  Result(int r, int d) : rank(r), num_dense(d) {}
};

/* Append sorted, unique linear keys over output levels [level, rank) to a chunk. */
template <class Take>
static void emit_sorted(Chunk& C, int level, int rank, const int64_t* dims,
                        const std::vector<int64_t>& keys, Take take) {
  const int m = rank - level;
  if (m == 1) {  // one level left: keys are its coordinates
    std::vector<I>& crd = C.crd[level];
    for (int64_t key : keys) { crd.push_back((I)key); C.val.push_back(take(key)); }
    return;
  }
  int64_t prev[16], cur[16];
  bool first = true;
  for (int64_t key : keys) {
    int64_t rest = key;
    for (int j = m - 1; j >= 0; --j) { cur[j] = rest % dims[j]; rest /= dims[j]; }
    int d = 0;
    if (!first) while (d < m && cur[d] == prev[d]) ++d;
    for (int j = d; j < m; ++j) {
      const int l = level + j;
      C.crd[l].push_back((I)cur[j]);
      if (j > 0) C.cnt[l].back()++;
      if (l + 1 < rank) C.cnt[l + 1].push_back(0);
      prev[j] = cur[j];
    }
    C.val.push_back(take(key));
    first = false;
  }
}

/* Dense workspace: values over the whole workspace, a bitmap of touched keys and
   their list. Drained in key order: by walking the bitmap's set bits (n / 64 words +
   k keys), or by sorting the list when far fewer keys were touched than words. */
struct DenseWS {
  std::vector<V> val;
  std::vector<uint64_t> bits;
  std::vector<int64_t> list;
  void init(int64_t n) { val.assign(n, V(0)); bits.assign((n + 63) / 64, 0); }
  inline void add(int64_t x, V v) {
    uint64_t& word = bits[x >> 6];
    const uint64_t bit = uint64_t(1) << (x & 63);
    if (word & bit) { val[x] += v; } else { word |= bit; val[x] = v; list.push_back(x); }
  }
  void drain(Chunk& C, int level, int rank, const int64_t* dims) {
    const int64_t k = (int64_t)list.size();
    if (k == 0) return;
    if (k * (64 - __builtin_clzll((unsigned long long)k)) < (int64_t)bits.size()) {
      std::sort(list.begin(), list.end());
      for (int64_t x : list) bits[x >> 6] = 0;
    } else {
      list.clear();
      for (int64_t w = 0; w < (int64_t)bits.size(); ++w) {
        for (uint64_t word = bits[w]; word; word &= word - 1)
          list.push_back(w * 64 + __builtin_ctzll(word));
        bits[w] = 0;
      }
    }
    emit_sorted(C, level, rank, dims, list, [&](int64_t x) { const V v = val[x]; val[x] = V(0); return v; });
    list.clear();
  }
};

/* Two-phase workspaces over keys [0, n), n < 2^32 (a dense workspace's size). A key
   is new in the current row when its stamp is not the row's; keys are stamped without
   branches and without sharing words (a bitmap's read-modify-writes of one word would
   chain). Phase 1 only counts each row's keys. */
struct CountWS {
  std::vector<uint32_t> seen;
  uint32_t row = 1;
  int64_t n = 0;
  void init(int64_t size) { seen.assign(size, 0); }
  inline void mark(int64_t x) {
    n += seen[x] != row;
    seen[x] = row;
  }
  int64_t count() {
    const int64_t k = n;
    n = 0;
    if (++row == 0) { std::fill(seen.begin(), seen.end(), 0); row = 1; }
    return k;
  }
};

/* Index array of the result, int32 or int64 as the caller allocated it: one copy of
   sn_fill and of the fill phase serves both widths (a template per width doubled their
   build time), the width test is loop-invariant. */
struct IndexOut {
  void* base;
  int wide;
  inline void put(int64_t q, int64_t x) const {
    if (wide) ((int64_t*)base)[q] = x; else ((int32_t*)base)[q] = (int32_t)x;
  }
};

/* Phase 2 also sums values (zeroed again as they are drained; a key's sum and stamp
   share a cache line) and lists the row's keys (a repeated key is written past the
   list's end). drain writes them in order with their sums: a short list by insertion
   sort; else through a two-level bitmap (a bit per key, and per 64 words a summary
   word of the non-zero ones), set from the list and walked between the smallest and
   largest key, O(k) whatever the key range. */
struct FillWS {
  struct Slot { V val; uint32_t seen; };
  std::vector<Slot> slot;
  std::vector<uint64_t> bits, summary;
  std::unique_ptr<uint32_t[]> list;
  uint32_t row = 1;
  int64_t n = 0;
  void init(int64_t size) {
    slot.assign(size, Slot{V(0), 0});
    bits.assign((size + 63) / 64, 0);
    summary.assign((size + 4095) / 4096, 0);
    list.reset(new uint32_t[size + 1]);
  }
  inline void add(int64_t x, V v) {
    Slot& e = slot[x];
    const bool fresh = e.seen != row;
    e.seen = row;
    list[n] = (uint32_t)x;
    n += fresh;
    e.val += v;
  }
  int64_t drain(const IndexOut& crd, int64_t at, V* __restrict__ out) {
    const int64_t k = n;
    if (k == 0) return 0;
    n = 0;
    if (++row == 0) { for (Slot& e : slot) e.seen = 0; row = 1; }
    uint32_t* keys = list.get();
    if (k <= 16) {
      for (int64_t t = 1; t < k; ++t) {
        const uint32_t x = keys[t];
        int64_t u = t;
        for (; u > 0 && keys[u - 1] > x; --u) keys[u] = keys[u - 1];
        keys[u] = x;
      }
      for (int64_t t = 0; t < k; ++t) {
        const uint32_t x = keys[t];
        crd.put(at + t, x);
        out[t] = slot[x].val;
        slot[x].val = V(0);
      }
      return k;
    }
    uint32_t lo = keys[0], hi = keys[0];
    uint64_t run = 0;  // bits of word w, or'ed in once per run of keys in that word
    uint32_t w = keys[0] >> 6;
    for (int64_t t = 0; t < k; ++t) {
      const uint32_t x = keys[t];
      lo = std::min(lo, x);
      hi = std::max(hi, x);
      if ((x >> 6) != w) {
        bits[w] |= run;
        summary[w >> 6] |= uint64_t(1) << (w & 63);
        run = 0;
        w = x >> 6;
      }
      run |= uint64_t(1) << (x & 63);
    }
    bits[w] |= run;
    summary[w >> 6] |= uint64_t(1) << (w & 63);
    int64_t q = 0;
    for (int64_t s = lo >> 12; s <= (int64_t)(hi >> 12); ++s) {
      for (uint64_t sw = summary[s]; sw; sw &= sw - 1) {
        const int64_t b = s * 64 + __builtin_ctzll(sw);
        for (uint64_t word = bits[b]; word; word &= word - 1) {
          const int64_t x = b * 64 + __builtin_ctzll(word);
          crd.put(at + q, x);
          out[q++] = slot[x].val;
          slot[x].val = V(0);
        }
        bits[b] = 0;
      }
      summary[s] = 0;
    }
    return k;
  }
};

/* Sparse accumulator: (key, value) pairs, stably sorted and combined at drain time. */
struct SparseWS {
  std::vector<std::pair<int64_t, V>> entries;
  std::vector<int64_t> keys;
  std::vector<V> vals;
  void init(int64_t) {}
  inline void add(int64_t x, V v) { entries.emplace_back(x, v); }
  void drain(Chunk& C, int level, int rank, const int64_t* dims) {
    if (entries.empty()) return;
    std::stable_sort(entries.begin(), entries.end(),
                     [](const std::pair<int64_t, V>& a, const std::pair<int64_t, V>& b) { return a.first < b.first; });
    keys.clear(); vals.clear();
    for (const auto& kv : entries) {
      if (!keys.empty() && keys.back() == kv.first) vals.back() += kv.second;
      else { keys.push_back(kv.first); vals.push_back(kv.second); }
    }
    entries.clear();
    size_t n = 0;
    emit_sorted(C, level, rank, dims, keys, [&](int64_t) { return vals[n++]; });
  }
};

extern "C" void sn_sizes(void* handle, int64_t* sizes) {
  const Result* r = (const Result*)handle;
  if (!r->pos.empty()) {  // two-phase: dense levels, then one compressed level
    std::fill(sizes, sizes + 2 * r->rank + 1, 0);
    sizes[2 * r->num_dense] = sizes[2 * r->rank] = r->pos.back();
    sizes[2 * r->num_dense + 1] = (int64_t)r->pos.size() - 1;
    return;
  }
  for (int l = 0; l < r->rank; ++l) {
    int64_t crd = 0, cnt = 0;
    for (const Chunk& c : r->chunks) {
      if (c.crd.empty()) continue;
      crd += (int64_t)c.crd[l].size();
      cnt += (int64_t)c.cnt[l].size();
    }
    sizes[2 * l] = crd;
    sizes[2 * l + 1] = cnt;
  }
  int64_t vals = 0;
  for (const Chunk& c : r->chunks) vals += (int64_t)c.val.size();
  sizes[2 * r->rank] = vals;
}

/* pos arrays are exclusive prefix sums of the concatenated per-parent counts. */
static int sn_fill(Result* r, void* const* out, int wide, int nthreads) {
  const int64_t nc = (int64_t)r->chunks.size();
  int slot = 0;
  std::vector<int64_t> crd_off(nc + 1), cnt_off(nc + 1), sum_off(nc + 1);
  for (int l = r->num_dense; l < r->rank; ++l) {
    const IndexOut pos{out[slot++], wide};
    const IndexOut crd{out[slot++], wide};
    crd_off[0] = cnt_off[0] = sum_off[0] = 0;
    for (int64_t c = 0; c < nc; ++c) {
      const Chunk& ch = r->chunks[c];
      const bool live = !ch.crd.empty();
      crd_off[c + 1] = crd_off[c] + (live ? (int64_t)ch.crd[l].size() : 0);
      cnt_off[c + 1] = cnt_off[c] + (live ? (int64_t)ch.cnt[l].size() : 0);
      int64_t s = 0;
      if (live) for (int64_t v : ch.cnt[l]) s += v;
      sum_off[c + 1] = sum_off[c] + s;
    }
    pos.put(0, 0);
    if (l == 0) pos.put(1, crd_off[nc]);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t c = 0; c < nc; ++c) {
      const Chunk& ch = r->chunks[c];
      if (ch.crd.empty()) continue;
      int64_t q = crd_off[c];
      for (I x : ch.crd[l]) crd.put(q++, x);
      if (l > 0) {
        int64_t run = sum_off[c], p = cnt_off[c] + 1;
        for (int64_t v : ch.cnt[l]) { run += v; pos.put(p++, run); }
      }
    }
  }
  V* val = (V*)out[slot];
  int64_t off = 0;
  std::vector<int64_t> val_off(nc + 1, 0);
  for (int64_t c = 0; c < nc; ++c) { val_off[c] = off; off += (int64_t)r->chunks[c].val.size(); }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t c = 0; c < nc; ++c)
    std::copy(r->chunks[c].val.begin(), r->chunks[c].val.end(), val + val_off[c]);
  return 0;
}

extern "C" void sn_free(void* handle) { delete (Result*)handle; }
"""


def _fold_halves(total: str, width: int, keep: int, lines: list[str], fresh: list[int]) -> str:
    """Emit ``t = total + (total's upper half moved onto its lower half)``, halving the
    lanes that matter until ``keep`` remain; returns the name of the vector holding them."""
    live = width
    while live > keep:
        half = live // 2
        fresh[0] += 1
        mask = [l + half if l < half else l for l in range(width)]
        lines.append(f"  const VV t{fresh[0]} = {total} + SN_SHUFFLE({total}, {total}, {', '.join(map(str, mask))});")
        total, live = f"t{fresh[0]}", half
    return total


def _hsums_source(width: int, rows: int, vectors: int) -> str:
    """``sn_hsum(v)``, the sum of v's lanes as a tree of vector shuffles and adds
    (log2(width) dependent adds, no round trip through memory), and
    ``sn_hsums(acc, out)``: ``out[r] = sum of the lanes of sum_v acc[r][v]`` for
    ``r < rows``, by a transpose-and-add: pairing vectors ``a, b`` whose lanes hold
    ``s`` rows each (lane ``l`` holds row ``l mod s``) and adding lanes ``l`` and ``l + s``
    of each block of ``2 s`` gives one vector holding their ``2 s`` rows; with every row
    in one vector, halves are folded until ``rows`` lanes remain. Row groups of ``width``
    if ``rows`` exceeds it. ``rows`` and ``width`` are powers of two."""
    lines = ["static inline V sn_hsum(VV v) {"]
    lines.append(f"  return {_fold_halves('v', width, 1, lines, [0])}[0];")
    lines.append("}")
    fresh, group = [0], min(rows, width)
    lines.append(f"static inline void sn_hsums(const VV (&acc)[{rows}][{vectors}], V* out) {{")
    for r in range(rows):
        lines.append(f"  const VV s{r} = {' + '.join(f'acc[{r}][{v}]' for v in range(vectors))};")
    for first in range(0, rows, group):
        level, size = [f"s{r}" for r in range(first, first + group)], 1
        while len(level) > 1:
            pick_low = [i for b in range(0, width, 2 * size) for i in [*range(b, b + size), *range(width + b, width + b + size)]]
            pick_high = [i + size for i in pick_low]
            paired = []
            for a, b in zip(level[::2], level[1::2]):
                fresh[0] += 1
                lines.append(
                    f"  const VV t{fresh[0]} = SN_SHUFFLE({a}, {b}, {', '.join(map(str, pick_low))}) + "
                    f"SN_SHUFFLE({a}, {b}, {', '.join(map(str, pick_high))});"
                )
                paired.append(f"t{fresh[0]}")
            level, size = paired, 2 * size
        total = _fold_halves(level[0], width, group, lines, fresh)
        lines.append(f"  std::memcpy(out + {first}, &{total}, {group} * sizeof(V));")
    return "\n".join(lines + ["}"])


def slot_arrays(slot: Slot) -> list[tuple[str, int]]:
    """The arrays a slot passes, in order: ("pos"|"crd", level) ..., ("val", -1);
    a dense slot passes ("dense", -1)."""
    if slot.fmt is None:
        return [("dense", -1)]
    arrays: list[tuple[str, int]] = []
    for level, lvl in enumerate(slot.fmt.levels):
        if lvl.has_pos:
            arrays.append(("pos", level))
        if lvl.has_crd:
            arrays.append(("crd", level))
    return arrays + [("val", -1)]


def generate_source(kernel: LoweredKernel, value_dtype: str, index_dtype: str) -> str:
    """The complete C++ translation unit for ``kernel``."""
    prelude = _PRELUDE if kernel.dense_output else _PRELUDE + _SPARSE_OUTPUT_PRELUDE
    prelude = (
        prelude.replace("@V@", _CTYPES[value_dtype])
        .replace("@I@", _CTYPES[index_dtype])
        .replace("@IV@", _LANE_INTS.get(value_dtype, _CTYPES[value_dtype]))
        .replace(
            "@HSUMS@",
            _hsums_source(kernel.vector_bytes // _ITEMSIZE[value_dtype], kernel.row_block, kernel.row_block_vectors),
        )
        .replace("@VECTOR_BYTES@", str(kernel.vector_bytes))
    )
    inputs, n = [], 0
    for s, slot in enumerate(kernel.slots):
        for kind, level in slot_arrays(slot):
            if kind == "dense":
                name, ctype = f"d{s}", "V"
            elif kind == "val":
                name, ctype = f"s{s}_val", "V"
            else:
                name, ctype = f"s{s}_{kind}{level}", "I"
            inputs.append(f"    const {ctype}* __restrict__ {name} = (const {ctype}*)arrays[{n}];")
            n += 1
    unpack = list(inputs)
    if kernel.dense_output:
        unpack.append(f"    V* __restrict__ out = (V*)arrays[{n}];")
        unpack.append("    (void)handle;")
    return (
        prelude
        + '\nextern "C" int sn_run(void* const* arrays, const int64_t* dims, int nthreads, void** handle) {\n'
        + "  try {\n"
        + "\n".join(unpack)
        + "\n"
        + kernel.body
        + "\n    return 0;\n"
        + "  } catch (const std::bad_alloc&) {\n    return 1;\n  }\n}\n"
        + ("" if kernel.dense_output else _finish(kernel, inputs))
    )


def _finish(kernel: LoweredKernel, inputs: list[str]) -> str:
    """``sn_finish``: copies the chunks' buffers out, or runs a two-phase output's fill."""
    source, call = "", "sn_fill(r, out, wide, nthreads)"
    if kernel.fill is not None:
        call = "sn_fill_phase(r, out, wide, nthreads)"
        source = (
            "\nstatic int sn_fill_phase(Result* r, void* const* out, int wide, int nthreads) {\n"
            "    void* const* arrays = r->arrays;\n    const int64_t* dims = r->dims;\n"
            + "\n".join(inputs) + "\n" + kernel.fill + "\n    return 0;\n}\n"
        )
    return source + (
        '\nextern "C" int sn_finish(void* handle, void* const* out, int wide, int nthreads) {\n'
        "  Result* r = (Result*)handle;\n  int code = 0;\n  try {\n"
        f"    code = {call};\n"
        "  } catch (const std::bad_alloc&) {\n    code = 1;\n  }\n  delete r;\n  return code;\n}\n"
    )
