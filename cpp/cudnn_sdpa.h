/* The C interface of the cuDNN attention shim (cpp/cudnn_sdpa.cpp, `cuda` builds only).
 *
 * cuDNN's fused flash attention (SDPA) forward and backward, through NVIDIA's header-only
 * cudnn-frontend graph API, behind a plain C ABI that the Rust side (src/engine/sdpa/) calls.
 * The shim holds no state of its own besides what these calls hand back: the Rust side owns
 * the handle, caches the built graphs by their descriptor and owns the workspace, so that the
 * call sequence (shapes, strides, workspace, cache keys) is Rust code tested on the CPU
 * against a recording stand-in.
 *
 * cuDNN itself is not linked: the Rust side dlopens libcudnn.so.9 and hands the handle to
 * `pg_cudnn_init`, which the frontend's dynamic loading (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING)
 * resolves every backend entry point through. The frontend also dlopens libcudart.so.{12,13}
 * (or CUDNN_FRONTEND_CUDART_LIB_NAME) for the few runtime calls it makes.
 *
 * Every function returns 0 on success, non-zero on failure with a NUL-terminated message in
 * `err` (at most `err_len` bytes, truncated). None throws across the ABI.
 *
 * Tensors are bf16 (q, k, v, o, do, dq, dk, dv), statistics f32, sequence lengths and ragged
 * offsets int32. Strides are in elements, given in the order (batch, head, sequence, dim): the
 * engine's token-major rows `(B*T, H*D)` with row stride `ld` are (T*ld, D, ld, 1).
 */
#ifndef PIPELINE_CUDNN_SDPA_H
#define PIPELINE_CUDNN_SDPA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What a graph computes; equal descriptors give interchangeable graphs. */
typedef struct pg_sdpa_desc {
    /* 0: forward (o and the softmax statistics from q, k, v);
     * 1: backward (dq, dk, dv from q, k, v, o, do and the forward's statistics). */
    int32_t backward;
    /* Causal (top-left aligned: query i sees keys 0..=i of its sequence): 1; full: 0. */
    int32_t causal;
    /* Documents (cuDNN's ragged "THD" layout with a padding mask): 1 makes `b` the number of
     * document slots, each with its own length (seq_len_q / seq_len_kv) and its first element
     * (the ragged offsets), causal within itself; 0: `b` sequences of `s` tokens. */
    int32_t ragged;
    /* A deterministic backward (no atomics in dq) where cuDNN offers one: 1. */
    int32_t deterministic;
    /* Sequences (or document slots), query heads, key/value heads (dividing h), the longest
     * sequence, head width. */
    int64_t b, h, h_kv, s, d;
    /* With `ragged`: the most tokens all slots hold together (cuDNN's max_total_seq_len). */
    int64_t max_total;
    /* Softmax scale (1/sqrt(d)). */
    float scale;
    /* Element strides (batch, head, seq, dim) of each bf16 tensor. In the backward, do has o's
     * strides, and dq, dk, dv their own. */
    int64_t q[4], k[4], v[4], o[4];
    int64_t dq[4], dk[4], dv[4];
    /* The statistics' strides (batch, head, seq, 1): per query, the log-sum-exp of its scaled
     * scores (natural log), f32. */
    int64_t stats[4];
} pg_sdpa_desc;

/* Device buffers of one execution (unused ones NULL). Ragged offsets are in elements of the
 * tensor they index, b + 1 entries each; sequence lengths b entries. */
typedef struct pg_sdpa_ptrs {
    void *q, *k, *v, *o, *dout, *dq, *dk, *dv;
    float *stats;
    int32_t *seq_len_q, *seq_len_kv;
    int32_t *off_q, *off_k, *off_v, *off_o, *off_dq, *off_dk, *off_dv, *off_stats;
} pg_sdpa_ptrs;

/* The cuDNN library's version (cudnnGetVersion, e.g. 92801) after binding `dlhandle` (from
 * dlopen of libcudnn.so.9) as the frontend's library handle; 0 on failure. Once per process. */
int pg_cudnn_init(void *dlhandle, int64_t *version, char *err, size_t err_len);

/* A cuDNN handle that queues its work on `stream` (a CUstream / cudaStream_t). */
int pg_cudnn_handle_create(void *stream, void **handle, char *err, size_t err_len);
void pg_cudnn_handle_destroy(void *handle);

/* Builds (validates, lowers, picks an engine by heuristics, compiles) the graph of `desc` on
 * `handle`'s device; its workspace need in bytes. An error names why cuDNN refused it. */
int pg_sdpa_build(void *handle, const pg_sdpa_desc *desc, void **graph, int64_t *workspace_bytes, char *err, size_t err_len);

/* Runs a built graph on `handle`'s stream with `workspace` (at least the build's bytes; NULL
 * when it needed none). Enqueues only: no allocation, no synchronisation, so that it can be
 * captured into a CUDA graph. */
int pg_sdpa_execute(void *handle, void *graph, const pg_sdpa_ptrs *ptrs, void *workspace, char *err, size_t err_len);

void pg_sdpa_destroy(void *graph);

#ifdef __cplusplus
}
#endif

#endif
