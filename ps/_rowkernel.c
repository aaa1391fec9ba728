/* The sparse table's row kernel: one pass over a request's rows (ps/rowkernel.py loads it with ctypes,
 * which releases the GIL for the call).
 *
 * Rows live in a RowStore: row r is in chunk r >> shift at offset r & mask, each chunk holding one
 * array per column. A column is passed as a table of per-chunk base pointers.
 *
 * Bitwise contract: for what it covers, tk_push gives exactly the floats of ps/optim.py's torch path
 * on this machine. Every multiply-add that torch's vectorized CPU kernels fuse (Vectorized::fmadd in
 * add/add_ with alpha and in lerp, the fused Adagrad kernel's, addcmul's and the vector_norm
 * reduction's multiply-adds as GCC contracts them) is an explicit fmaf here, and nothing else is
 * contracted (built with -ffp-contract=off); the row-wise norm sums in torch's vector width (``lanes``)
 * and order. Square roots are correctly rounded on both sides, and Adam's beta**step is repeated
 * squaring on both (ps/optim.py's _sqrt and _powi: torch's own are not correctly rounded).
 * tests/unit/test_rowkernel.py checks this against the torch path.
 *
 * Plain C, no Python.h: a build needs a C compiler only. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TK_SGD 0
#define TK_MOMENTUM 1
#define TK_NESTEROV 2
#define TK_ADAGRAD 3
#define TK_ROWWISE_ADAGRAD 4
#define TK_ADAM 5
#define TK_ADAMW 6
#define TK_FTRL 7

#define TK_MAX_LANES 16

/* hparams as Python has them (doubles; 0 where the optimizer has none) */
typedef struct {
    double lr, weight_decay, eps, momentum, lr_decay, beta1, beta2, beta, l1, l2;
} tk_hparams;

/* what the update reads of them, made once per push: floats cast the way torch casts a Python scalar
 * for a float32 tensor (after the same double arithmetic Python does, e.g. 1 - beta1) */
typedef struct {
    float lr, wd, eps, mu;
    float w1, w1m1;   /* Adam: exp_avg.lerp_(g, 1 - beta1)'s weight, and weight - 1 */
    int w1_small;     /* |weight| < 0.5: torch's lerp takes the form from the start */
    float b2, c2;     /* Adam: exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2) */
    float decay;      /* AdamW: param.mul_(1 - lr * weight_decay) */
    float beta, l1, l2; /* FTRL */
} tk_consts;

static void make_consts(const tk_hparams *h, tk_consts *c) {
    c->lr = (float)h->lr;
    c->wd = (float)h->weight_decay;
    c->eps = (float)h->eps;
    c->mu = (float)h->momentum;
    c->w1 = (float)(1.0 - h->beta1);
    c->w1m1 = c->w1 - 1.0f;
    c->w1_small = fabsf(c->w1) < 0.5f;
    c->b2 = (float)h->beta2;
    c->c2 = (float)(1.0 - h->beta2);
    c->decay = (float)(1.0 - h->lr * h->weight_decay);
    c->beta = (float)h->beta;
    c->l1 = (float)h->l1;
    c->l2 = (float)h->l2;
}

/* b**k for k >= 0 by repeated squaring (double multiplies only: ps/optim.py's _powi, the same bits) */
static inline double powi(double b, int64_t k) {
    double out = 1.0;
    while (k > 0) {
        if (k & 1)
            out = out * b;
        b = b * b;
        k >>= 1;
    }
    return out;
}

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* one build, each CPU's widest vector units (the arithmetic is the same: fmaf is exact either way) */
#define TK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TK_CLONES
#endif

static inline float *f32_at(float *const *chunks, int64_t r, int shift, int64_t mask, int64_t width) {
    return chunks[r >> shift] + (r & mask) * width;
}

/* Random rows miss every cache: ask for the row TK_AHEAD places ahead while this one computes (the
 * update's dependency chain keeps the CPU from running far enough ahead by itself). */
#define TK_AHEAD 16

static inline void prefetch_bytes(const void *p, int64_t nbytes, int write) {
    const char *c = (const char *)p;
    for (int64_t b = 0; b < nbytes; b += 64) {
        if (write)
            __builtin_prefetch(c + b, 1, 3);
        else
            __builtin_prefetch(c + b, 0, 3);
    }
}

/* Adam on one row: ``decoupled`` (AdamW: param.mul_(1 - lr * wd) first, the gradient as it is) or
 * ``l2`` (g + wd * param); m.lerp_(g, 1 - b1) (torch's lerp: fma(w, g - m, m) for |w| < 0.5, else
 * fma(w - 1, g - m, g)); v.mul_(b2).addcmul_(g, g, value=1 - b2) (GCC contracts torch's addcmul);
 * p -= m / (sqrt(v) / bc2_sqrt + eps) * step_size. The flags are constants where it is inlined. */
static inline __attribute__((always_inline)) void adam_row(int decoupled, int l2, const tk_consts *c, float step_size, float bc2_sqrt,
                                                           int64_t dim, float *restrict p, const float *restrict g,
                                                           float *restrict m, float *restrict v) {
    const float decay = c->decay, wd = c->wd, b2 = c->b2, c2 = c->c2, eps = c->eps;
    const float coeff = c->w1_small ? c->w1 : c->w1m1;
    const int small = c->w1_small;
    for (int64_t d = 0; d < dim; d++) {
        float pd = p[d], gd = g[d], md = m[d];
        if (decoupled)
            pd = pd * decay;
        if (l2)
            gd = fmaf(pd, wd, gd);
        md = fmaf(coeff, gd - md, small ? md : gd);
        m[d] = md;
        float vd = fmaf(c2 * gd, gd, v[d] * b2);
        v[d] = vd;
        p[d] = pd - (md / (sqrtf(vd) / bc2_sqrt + eps)) * step_size;
    }
}

/* p: the row's fp32 values (updated in place), g: its gradient, s0/s2: elementwise state rows, a:
 * the row-wise accumulator, step: the row's update count, this one included (its new version) */
static inline __attribute__((always_inline)) void update_row(int opt, int lanes, int64_t dim, const tk_hparams *h, const tk_consts *c,
                       int64_t step, float *restrict p, const float *restrict g, float *restrict s0, float *restrict a,
                       float *restrict s2) {
    const float lr = c->lr, wd = c->wd;
    switch (opt) {
    case TK_SGD: /* param.add_(grad (+ wd*param), alpha=-lr) */
        for (int64_t d = 0; d < dim; d++) {
            float gd = wd != 0.0f ? fmaf(p[d], wd, g[d]) : g[d];
            p[d] = fmaf(gd, -lr, p[d]);
        }
        break;
    case TK_MOMENTUM:
    case TK_NESTEROV: /* buf.mul_(mu).add_(g); param.add_(buf or g + mu*buf, alpha=-lr) */
        for (int64_t d = 0; d < dim; d++) {
            float gd = wd != 0.0f ? fmaf(p[d], wd, g[d]) : g[d];
            float b = s0[d] * c->mu + gd;
            s0[d] = b;
            float upd = opt == TK_NESTEROV ? fmaf(b, c->mu, gd) : b;
            p[d] = fmaf(upd, -lr, p[d]);
        }
        break;
    case TK_ADAGRAD:
        if (h->lr_decay == 0.0) { /* torch._fused_adagrad_: sum += g*g; p -= lr*g / (sqrt(sum) + eps) */
            for (int64_t d = 0; d < dim; d++) {
                float gd = wd != 0.0f ? fmaf(p[d], wd, g[d]) : g[d];
                float s = fmaf(gd, gd, s0[d]);
                s0[d] = s;
                float std = sqrtf(s) + c->eps;
                p[d] = p[d] - (lr * gd) / std;
            }
        } else { /* ps.optim.Adagrad's per-row path: clr = lr / (1 + (step - 1) lr_decay) in double;
                    sum.addcmul_(g, g); p.sub_(g / (sqrt(sum) + eps) * clr) */
            float clr = (float)(h->lr / (1.0 + (double)(step - 1) * h->lr_decay));
            for (int64_t d = 0; d < dim; d++) {
                float gd = wd != 0.0f ? fmaf(p[d], wd, g[d]) : g[d];
                float s = fmaf(gd, gd, s0[d]);
                s0[d] = s;
                float std = sqrtf(s) + c->eps;
                p[d] = p[d] - (gd / std) * clr;
            }
        }
        break;
    case TK_ADAM:
    case TK_ADAMW: { /* ps.optim.Adam's per-row path (lazy Adam): bias corrections of the row's own step, in
                        double, cast to float */
        float step_size = (float)(h->lr / (1.0 - powi(h->beta1, step)));
        float bc2_sqrt = (float)sqrt(1.0 - powi(h->beta2, step));
        if (opt == TK_ADAMW) /* one loop per form, each without branches: vectorized */
            adam_row(1, 0, c, step_size, bc2_sqrt, dim, p, g, s0, s2);
        else if (wd != 0.0f)
            adam_row(0, 1, c, step_size, bc2_sqrt, dim, p, g, s0, s2);
        else
            adam_row(0, 0, c, step_size, bc2_sqrt, dim, p, g, s0, s2);
        break;
    }
    case TK_FTRL: { /* ps.optim.FTRL: z (s0) and n (s2), every op rounded on its own as torch's separate ops */
        const float l1 = c->l1, l2 = c->l2, beta = c->beta;
        for (int64_t d = 0; d < dim; d++) {
            float gd = g[d], n_old = s2[d];
            float n_new = n_old + gd * gd;
            float root = sqrtf(n_new);
            float sigma = (root - sqrtf(n_old)) / lr;
            float z = s0[d] + (gd - sigma * p[d]);
            s0[d] = z;
            s2[d] = n_new;
            float sign = z > 0.0f ? 1.0f : (z < 0.0f ? -1.0f : 0.0f);
            float w = -(z - sign * l1) / ((beta + root) / lr + l2);
            p[d] = fabsf(z) <= l1 ? 0.0f : w;
        }
        break;
    }
    case TK_ROWWISE_ADAGRAD: { /* acc += vector_norm(g)^2 / dim; p -= g * (lr / (sqrt(acc) + eps)) */
        /* g (+ wd*p) is needed twice, for the norm and for the update: with decay, kept here (rows are short) */
        float gw[wd != 0.0f && dim > 0 ? dim : 1];
        const float *gg = g;
        if (wd != 0.0f) {
            for (int64_t e = 0; e < dim; e++)
                gw[e] = fmaf(p[e], wd, g[e]);
            gg = gw;
        }
        float acc[TK_MAX_LANES] = {0};
        int64_t d = 0;
        int64_t whole = dim - dim % lanes;
        for (; d < whole; d += lanes)
            for (int j = 0; j < lanes; j++)
                acc[j] = acc[j] + gg[d + j] * gg[d + j];
        float sum = acc[0];
        for (int j = 1; j < lanes; j++)
            sum = sum + acc[j];
        for (; d < dim; d++)
            sum = fmaf(gg[d], gg[d], sum);
        float norm = sqrtf(sum);
        if (dim)
            *a = *a + (norm * norm) / (float)dim;
        float scale = (1.0f / (sqrtf(*a) + c->eps)) * lr;
        for (int64_t e = 0; e < dim; e++)
            p[e] = fmaf(-gg[e], scale, p[e]);
        break;
    }
    }
}

/* Row dtypes: values are stored as float32, float16 (round to nearest even on the way back) or
 * bfloat16 (stochastic rounding, ps/rowdtype.py: a hash of (table key, row id, new version, column));
 * the optimizer always runs in fp32. float16 needs the compiler's _Float16 (tk_features says). */
#define TK_F32 0
#define TK_F16 1
#define TK_BF16 2

#ifdef __FLT16_MAX__
#define TK_HAVE_F16 1
#else
#define TK_HAVE_F16 0
#endif

/* bit 0: float16 rows supported */
int tk_features(void) { return TK_HAVE_F16; }

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint64_t mix64(uint64_t z) { /* splitmix64's finalizer, as ps.partition.mix64 */
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

/* ps.rowdtype.stochastic_round_bf16 of one row: row key = mix64(id ^ table_key ^ version * golden),
 * 16 noise bits per column (lowbias32), added to the fp32 bits, low half dropped */
static inline void round_bf16_row(const float *x, uint16_t *out, int64_t dim, uint64_t table_key, int64_t id, int64_t version) {
    uint64_t key = mix64((uint64_t)id ^ table_key ^ ((uint64_t)version * 0x9E3779B97F4A7C15ULL));
    uint32_t k32 = (uint32_t)key;
    for (int64_t d = 0; d < dim; d++) {
        uint32_t z = k32 + (uint32_t)d * 0x9E3779B9u;
        z ^= z >> 16;
        z *= 0x7FEB352Du;
        z ^= z >> 15;
        z *= 0x846CA68Bu;
        z ^= z >> 16;
        uint32_t b;
        memcpy(&b, &x[d], 4);
        if (isnan(x[d]))
            out[d] = 0xFFFF; /* what torch's vectorized fp32 -> bf16 conversion makes of a NaN (the self-check confirms) */
        else
            out[d] = (uint16_t)((b + (z & 0xFFFFu)) >> 16);
    }
}

/* widen a stored row into p (fp32) */
static inline void load_row(int vdtype, const char *src, float *p, int64_t dim) {
    if (vdtype == TK_F32) {
        memcpy(p, src, (size_t)dim * 4);
    } else if (vdtype == TK_BF16) {
        const uint16_t *b = (const uint16_t *)src;
        for (int64_t d = 0; d < dim; d++)
            p[d] = bf16_to_f32(b[d]);
    } else {
#if TK_HAVE_F16
        const _Float16 *hf = (const _Float16 *)src;
        for (int64_t d = 0; d < dim; d++)
            p[d] = (float)hf[d];
#endif
    }
}

/* p (fp32, exactly representable in the row dtype already for f16/bf16 when ``exact``) into a stored row */
static inline void store_row(int vdtype, const float *p, char *dst, int64_t dim) {
    if (vdtype == TK_F32) {
        memcpy(dst, p, (size_t)dim * 4);
    } else if (vdtype == TK_BF16) {
        uint16_t *b = (uint16_t *)dst;
        for (int64_t d = 0; d < dim; d++) {
            uint32_t u;
            memcpy(&u, &p[d], 4);
            b[d] = (uint16_t)(u >> 16); /* exact: the low half is zero (or a NaN made 0xFFFF0000) */
        }
    } else {
#if TK_HAVE_F16
        _Float16 *hf = (_Float16 *)dst;
        for (int64_t d = 0; d < dim; d++)
            hf[d] = (_Float16)p[d];
#endif
    }
}

/* the new fp32 values p rounded to the row dtype, in place (then exactly representable) */
static inline void round_row(int vdtype, float *p, int64_t dim, uint64_t table_key, int64_t id, int64_t version) {
    if (vdtype == TK_BF16) {
        uint16_t tmp[dim > 0 ? dim : 1];
        round_bf16_row(p, tmp, dim, table_key, id, version);
        for (int64_t d = 0; d < dim; d++)
            p[d] = bf16_to_f32(tmp[d]);
    } else if (vdtype == TK_F16) {
#if TK_HAVE_F16
        for (int64_t d = 0; d < dim; d++)
            p[d] = (float)(_Float16)p[d];
#endif
    }
}

static inline int64_t itemsize(int vdtype) { return vdtype == TK_F32 ? 4 : 2; }

/* Apply one push to n rows (unique). Row i is store row rows[i] (row id ids[i]); its gradient is
 * grad row (grad_idx ? grad_idx[i] : i) of the (*, dim) fp32 ``grad``. Per row: widen the values,
 * the optimizer on them and the state (the row's step: its new version), round back to the row
 * dtype (``vdtype``), version + 1, touch = touch_val (if ``touch``). State columns: s0 and s2
 * elementwise (dim floats a row), s1 row-wise (one float a row); NULL where the optimizer has none.
 *
 * out_values == NULL: in place. Otherwise the store is only read: the new values (fp32, already
 * rounded to the row dtype), state and versions go to row i of out_values (n, dim), out_s0 / out_s2
 * (n, dim), out_s1 (n) and out_versions (n), for tk_scatter to store once the caller commits.
 *
 * Returns 0, or -1 for what it does not know (nothing written). */
TK_CLONES
int tk_push(int opt, int lanes, int vdtype, uint64_t table_key, int64_t n, int64_t dim, int shift, int64_t mask,
            const tk_hparams *h, const int64_t *rows, const int64_t *ids, const float *grad, const int64_t *grad_idx,
            char *const *values, float *const *s0, float *const *s1, float *const *s2, int64_t *const *version,
            int64_t *const *touch, int64_t touch_val,
            float *out_values, float *out_s0, float *out_s1, float *out_s2, int64_t *out_versions) {
    if (opt < TK_SGD || opt > TK_FTRL || lanes < 1 || lanes > TK_MAX_LANES || vdtype < TK_F32 || vdtype > TK_BF16 ||
        (vdtype == TK_F16 && !TK_HAVE_F16) || (vdtype == TK_BF16 && !ids))
        return -1;
    int has_s0 = opt == TK_MOMENTUM || opt == TK_NESTEROV || opt == TK_ADAGRAD || opt == TK_ADAM || opt == TK_ADAMW || opt == TK_FTRL;
    int has_s1 = opt == TK_ROWWISE_ADAGRAD;
    int has_s2 = opt == TK_ADAM || opt == TK_ADAMW || opt == TK_FTRL;
    tk_consts c;
    make_consts(h, &c);
    int64_t row_bytes = dim * itemsize(vdtype);
    float buf[dim > 0 ? dim : 1];
    for (int64_t i = 0; i < n; i++) {
        if (i + TK_AHEAD < n) {
            int64_t ra = rows[i + TK_AHEAD], ka = ra >> shift, oa = ra & mask;
            prefetch_bytes(values[ka] + oa * row_bytes, row_bytes, 1);
            if (has_s0)
                prefetch_bytes(s0[ka] + oa * dim, dim * (int64_t)sizeof(float), 1);
            if (has_s1)
                __builtin_prefetch(s1[ka] + oa, 1, 3);
            if (has_s2)
                prefetch_bytes(s2[ka] + oa * dim, dim * (int64_t)sizeof(float), 1);
            __builtin_prefetch(version[ka] + oa, 1, 3);
        }
        int64_t r = rows[i];
        int64_t k = r >> shift, off = r & mask;
        char *row = values[k] + off * row_bytes;
        const float *g = grad + (grad_idx ? grad_idx[i] : i) * dim;
        float *st = has_s0 ? s0[k] + off * dim : NULL;
        float *acc = has_s1 ? s1[k] + off : NULL;
        float *st2 = has_s2 ? s2[k] + off * dim : NULL;
        int64_t new_version = version[k][off] + 1;
        /* fp32 in place: the row itself; otherwise a widened copy (the out row, or buf) */
        float *p = out_values ? out_values + i * dim : (vdtype == TK_F32 ? (float *)row : buf);
        if (p != (float *)row)
            load_row(vdtype, row, p, dim);
        if (out_values) {
            if (has_s0) {
                memcpy(out_s0 + i * dim, st, (size_t)dim * sizeof(float));
                st = out_s0 + i * dim;
            }
            if (has_s1) {
                out_s1[i] = *acc;
                acc = out_s1 + i;
            }
            if (has_s2) {
                memcpy(out_s2 + i * dim, st2, (size_t)dim * sizeof(float));
                st2 = out_s2 + i * dim;
            }
            out_versions[i] = new_version;
        } else {
            version[k][off] = new_version;
            if (touch)
                touch[k][off] = touch_val;
        }
        update_row(opt, lanes, dim, h, &c, new_version, p, g, st, acc, st2);
        if (vdtype != TK_F32) {
            round_row(vdtype, p, dim, table_key, ids ? ids[i] : 0, new_version);
            if (!out_values)
                store_row(vdtype, p, row, dim);
        }
    }
    return 0;
}

/* Store what tk_push computed into out_* (row i -> store row rows[i]), touch = touch_val (if ``touch``). */
TK_CLONES
void tk_scatter(int vdtype, int64_t n, int64_t dim, int shift, int64_t mask, const int64_t *rows, int has_s0, int has_s1, int has_s2,
                const float *new_values, const float *new_s0, const float *new_s1, const float *new_s2, const int64_t *new_versions,
                char *const *values, float *const *s0, float *const *s1, float *const *s2, int64_t *const *version,
                int64_t *const *touch, int64_t touch_val) {
    int64_t row_bytes = dim * itemsize(vdtype);
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        int64_t k = r >> shift, off = r & mask;
        store_row(vdtype, new_values + i * dim, values[k] + off * row_bytes, dim);
        if (has_s0)
            memcpy(s0[k] + off * dim, new_s0 + i * dim, (size_t)dim * sizeof(float));
        if (has_s1)
            s1[k][off] = new_s1[i];
        if (has_s2)
            memcpy(s2[k] + off * dim, new_s2 + i * dim, (size_t)dim * sizeof(float));
        version[k][off] = new_versions[i];
        if (touch)
            touch[k][off] = touch_val;
    }
}

/* Pull: row i of ``out`` (n, row_bytes) = the row_bytes-byte values of store row rows[i] (any dtype),
 * out_versions[i] = its version. */
TK_CLONES
void tk_gather(int64_t n, int64_t row_bytes, int shift, int64_t mask, const int64_t *rows, char *const *values,
               int64_t *const *version, char *out, int64_t *out_versions) {
    for (int64_t i = 0; i < n; i++) {
        if (i + TK_AHEAD < n) {
            int64_t ra = rows[i + TK_AHEAD], ka = ra >> shift, oa = ra & mask;
            prefetch_bytes(values[ka] + oa * row_bytes, row_bytes, 0);
            if (out_versions)
                __builtin_prefetch(version[ka] + oa, 0, 3);
        }
        int64_t r = rows[i];
        int64_t k = r >> shift, off = r & mask;
        memcpy(out + i * row_bytes, values[k] + off * row_bytes, (size_t)row_bytes);
        if (out_versions)
            out_versions[i] = version[k][off];
    }
}

/* The id index (ps/index.py's HashIndex): open addressing with linear probing over ``mask + 1``
 * slots (a power of two). A slot holds an id and its value; TK_EMPTY never held one, TK_TOMB held a
 * deleted one (its id kept, so inserting it again revives the slot). Each id is in one slot at most.
 * An id's home slot is mix64(mix64(id ^ key[0]) + key[1]): ``key`` is the index's own random
 * 128 bits, so ids a caller picks to share a home slot collide no more than random ones. */
typedef struct __attribute__((packed)) {
    int64_t id;
    int32_t val;
} tk_slot; /* 12 bytes: the table is most of the index's memory */
#define TK_EMPTY INT32_MIN
#define TK_TOMB (INT32_MIN + 1)
#define TK_GROUP 16 /* ids whose home slots are prefetched together: their cache misses overlap */

static inline uint64_t tk_home(int64_t id, const uint64_t *key, int64_t mask) {
    return mix64(mix64((uint64_t)id ^ key[0]) + key[1]) & (uint64_t)mask;
}

/* The slot holding ``id`` (live or deleted), or -1 - (the first free slot on its probe: a deleted
 * one if any came before the empty one that ends the probe). */
static inline int64_t tk_probe(const tk_slot *t, int64_t mask, int64_t id, uint64_t h) {
    int64_t free_at = -1;
    for (;; h = (h + 1) & (uint64_t)mask) {
        int32_t v = t[h].val;
        if (v == TK_EMPTY)
            return -1 - (free_at >= 0 ? free_at : (int64_t)h);
        if (t[h].id == id)
            return (int64_t)h;
        if (v == TK_TOMB && free_at < 0)
            free_at = (int64_t)h;
    }
}

/* For i < n: the slot of ids[i] (as tk_probe) into at[i], home slots prefetched a group ahead. */
static void tk_probe_all(const tk_slot *t, int64_t mask, const uint64_t *key, const int64_t *ids, int64_t n, int64_t *at) {
    uint64_t home[TK_GROUP];
    for (int64_t g0 = 0; g0 < n; g0 += TK_GROUP) {
        int m = n - g0 < TK_GROUP ? (int)(n - g0) : TK_GROUP;
        for (int j = 0; j < m; j++) {
            home[j] = tk_home(ids[g0 + j], key, mask);
            __builtin_prefetch(t + home[j], 0, 3);
        }
        for (int j = 0; j < m; j++)
            at[g0 + j] = tk_probe(t, mask, ids[g0 + j], home[j]);
    }
}

/* out[i] = the value of ids[i], or -1 where it has none (absent or deleted). */
TK_CLONES
void tk_hash_lookup(const tk_slot *t, int64_t mask, const uint64_t *key, const int64_t *ids, int64_t n, int64_t *out) {
    if (mask < 0) {
        for (int64_t i = 0; i < n; i++)
            out[i] = -1;
        return;
    }
    tk_probe_all(t, mask, key, ids, n, out);
    for (int64_t i = 0; i < n; i++) {
        int32_t v = out[i] >= 0 ? t[out[i]].val : TK_TOMB;
        out[i] = v == TK_TOMB ? -1 : v;
    }
}

/* Add ids[i] -> vals[i] (ids unique, none live; room for all of them left by the caller). Returns
 * how many took a slot that had never held an id (the others revived or reused a deleted one). */
TK_CLONES
int64_t tk_hash_insert(tk_slot *t, int64_t mask, const uint64_t *key, const int64_t *ids, const int64_t *vals, int64_t n,
                       int64_t *scratch) {
    int64_t fresh = 0;
    tk_probe_all(t, mask, key, ids, n, scratch);
    for (int64_t i = 0; i < n; i++) {
        /* an earlier insert of this call may have taken the free slot found, or the deleted slot of
         * this id (reusing it for its own id): probe again then */
        int64_t at = scratch[i];
        if (at >= 0 ? t[at].id != ids[i] : t[-1 - at].val != TK_EMPTY && t[-1 - at].val != TK_TOMB)
            at = tk_probe(t, mask, ids[i], tk_home(ids[i], key, mask));
        if (at < 0) {
            at = -1 - at;
            fresh += t[at].val == TK_EMPTY;
            t[at].id = ids[i];
        }
        t[at].val = (int32_t)vals[i];
    }
    return fresh;
}

/* Set the value of each live ids[i] to vals[i] (vals NULL: delete it). Returns how many were live. */
TK_CLONES
int64_t tk_hash_set(tk_slot *t, int64_t mask, const uint64_t *key, const int64_t *ids, const int64_t *vals, int64_t n,
                    int64_t *scratch) {
    int64_t found = 0;
    if (mask < 0)
        return 0;
    tk_probe_all(t, mask, key, ids, n, scratch);
    for (int64_t i = 0; i < n; i++) {
        int64_t at = scratch[i];
        if (at >= 0 && t[at].val != TK_TOMB) {
            t[at].val = vals ? (int32_t)vals[i] : TK_TOMB;
            found++;
        }
    }
    return found;
}

/* Every live slot of ``old`` (``old_n`` slots) into the empty table ``t``. */
TK_CLONES
void tk_hash_move(const tk_slot *old, int64_t old_n, tk_slot *t, int64_t mask, const uint64_t *key) {
    for (int64_t i = 0; i < old_n; i++) {
        if (old[i].val == TK_EMPTY || old[i].val == TK_TOMB)
            continue;
        uint64_t h = tk_home(old[i].id, key, mask);
        while (t[h].val != TK_EMPTY)
            h = (h + 1) & (uint64_t)mask;
        t[h] = old[i];
    }
}

/* A pull's common case in one call: at[i] = the value of ids[i] in the index (as tk_hash_lookup);
 * if every id has a resident row (value >= 0), row i of ``out`` and out_versions[i] are its values
 * and version (as tk_gather) and it returns n, else it copies nothing and returns -1 - (the index of
 * the first id with no resident row). *increasing = ids strictly increasing (sorted, no duplicates). */
TK_CLONES
int64_t tk_hash_gather(const tk_slot *t, int64_t mask, const uint64_t *key, const int64_t *ids, int64_t n, int64_t *at,
                       int64_t row_bytes, int shift, int64_t rmask, char *const *values, int64_t *const *version, char *out,
                       int64_t *out_versions, int64_t *increasing) {
    int64_t inc = 1;
    for (int64_t i = 1; i < n && inc; i++)
        inc = ids[i] > ids[i - 1];
    *increasing = inc;
    tk_hash_lookup(t, mask, key, ids, n, at);
    for (int64_t i = 0; i < n; i++)
        if (at[i] < 0)
            return -1 - i;
    tk_gather(n, row_bytes, shift, rmask, at, values, version, out, out_versions);
    return n;
}

/* The shard of each id, as ps.partition.SlotMap.shard_of: its slot mix64(id) % num_slots, then
 * slot_shards[slot] (NULL: the default map, slot % num_shards). */
void tk_shard_of(const int64_t *ids, int64_t n, uint64_t num_slots, const int64_t *slot_shards, int64_t num_shards, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = mix64((uint64_t)ids[i]) % num_slots;
        out[i] = slot_shards ? slot_shards[s] : (int64_t)(s % (uint64_t)num_shards);
    }
}

/* The staleness of a push's rows: for row i (store row rows[i], gradient computed from version
 * base[i]; base[i] < 0: not measured), its version now minus base[i] where that is >= 0. Adds the
 * count, sum and max of those to stats[0..2] (max: stats[2], -1 when none yet). */
void tk_staleness(int64_t n, int shift, int64_t mask, const int64_t *rows, int64_t *const *version, const int64_t *base,
                  int64_t *stats) {
    for (int64_t i = 0; i < n; i++) {
        if (base[i] < 0)
            continue;
        int64_t d = version[rows[i] >> shift][rows[i] & mask] - base[i];
        if (d >= 0) {
            stats[0]++;
            stats[1] += d;
            if (d > stats[2])
                stats[2] = d;
        }
    }
}
