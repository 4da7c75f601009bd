/* cuDNN's fused flash attention (SDPA) behind the C ABI of cudnn_sdpa.h (`cuda` builds only),
 * written with cudnn-frontend's graph API (cudnn_frontend::graph::Graph).
 *
 * What a graph computes, per sequence (or document slot) n and query head i, whose key/value
 * head is j = i / (h / h_kv) (grouped-query attention: h / h_kv query heads share one), with
 * rows t (queries) and u (keys) of that sequence:
 *
 *   S[t, u]  = scale * <q[t], k[u]>           masked to u <= t when causal (top-left aligned)
 *   Stats[t] = log sum_u exp(S[t, u])         the row's log-sum-exp (natural log, f32)
 *   P[t, u]  = exp(S[t, u] - Stats[t])        the softmax
 *   O[t]     = sum_u P[t, u] v[u]
 *
 * The forward writes O and Stats: training mode, as the backward rebuilds P from Stats instead
 * of storing it. The backward, given dO (the loss's gradient with respect to O), writes
 *
 *   dP[t, u] = <dO[t], v[u]>,  D[t] = <dO[t], O[t]>,  dS[t, u] = P[t, u] (dP[t, u] - D[t])
 *   dQ[t] = scale * sum_u dS[t, u] k[u]
 *   dK[u] = scale * sum_t dS[t, u] q[t],  dV[u] = sum_t P[t, u] dO[t]   (dK, dV summed over the
 *                                                                        heads sharing them)
 *
 * accumulating in f32 and storing bf16. Deterministic backward: cuDNN's variant without atomic
 * adds into dQ (the same bits on every run, at some speed and workspace).
 *
 * Ragged ("documents", cuDNN's THD layout): `b` slots, slot n holding seq_len_q[n] queries and
 * seq_len_kv[n] keys (cuDNN's padding mask: positions past a slot's length take no part; `s`
 * is the longest), stored packed one after another: row 0 of slot n of tensor X is off_X[n]
 * elements into X's buffer (the ragged offsets, b + 1 entries, the last one the end), so no
 * padding is stored and the batch stride is not used. Causal masking is within each slot.
 * Stats is ragged too (off_stats), dO shares O's offsets.
 *
 * cuDNN is not linked: pg_cudnn_init binds the handle of the dlopened libcudnn.so.9 and the
 * frontend (built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING) resolves each cuDNN entry point
 * through it at first use; its few CUDA runtime calls go through a dlopened libcudart.
 */
#include "cudnn_sdpa.h"

#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <cudnn_frontend.h>

namespace fe = cudnn_frontend;

// The library handle through which the frontend's dynamic loading resolves cuDNN (declared by
// cudnn_frontend_shim.h, defined by the application); set by pg_cudnn_init.
void *cudnn_frontend::cudnn_dlhandle = nullptr;

namespace {

using Tensor = std::shared_ptr<fe::graph::Tensor_attributes>;

// Fixed ids of the graphs' tensors: the variant pack maps them to the buffers of pg_sdpa_ptrs.
enum Uid : int64_t {
    UID_Q = 1,
    UID_K,
    UID_V,
    UID_O,
    UID_DO,
    UID_STATS,
    UID_DQ,
    UID_DK,
    UID_DV,
    UID_SEQ_LEN_Q,
    UID_SEQ_LEN_KV,
    UID_OFF_Q,
    UID_OFF_K,
    UID_OFF_V,
    UID_OFF_O,
    UID_OFF_DQ,
    UID_OFF_DK,
    UID_OFF_DV,
    UID_OFF_STATS,
};

// A built graph and the descriptor it was built from (which buffers an execution binds).
struct SdpaGraph {
    fe::graph::Graph graph;
    pg_sdpa_desc desc;
};

// "fn: msg" into the caller's buffer (truncated, NUL-terminated); the failure code.
int fail(char *err, size_t err_len, const char *fn, const char *msg) noexcept {
    if (err != nullptr && err_len > 0) {
        std::snprintf(err, err_len, "%s: %s", fn, msg);
    }
    return 1;
}

// Runs `body` (which returns 0), turning any exception into a failure with its message: nothing
// throws across the C ABI.
template <class F>
int guarded(const char *fn, char *err, size_t err_len, F &&body) noexcept {
    try {
        return body();
    } catch (const std::exception &e) {
        return fail(err, err_len, fn, e.what());
    } catch (...) {
        return fail(err, err_len, fn, "unknown exception");
    }
}

// Throws `msg` unless `ok`.
void require(bool ok, const char *msg) {
    if (!ok) {
        throw std::runtime_error(msg);
    }
}

// A frontend call's error as an exception naming the step.
void check(fe::error_t status, const char *step) {
    if (status.is_good()) {
        return;
    }
    std::ostringstream msg;
    msg << step << " failed (" << status.get_code() << "): " << status.get_message();
    throw std::runtime_error(msg.str());
}

// A cuDNN call's status likewise, with cuDNN's own last message.
void check_cudnn(cudnnStatus_t status, const char *step) {
    if (status != CUDNN_STATUS_SUCCESS) {
        throw std::runtime_error(std::string(step) + " failed: " + fe::detail::get_error_string(status) + " " +
                                 fe::detail::get_last_error_string_());
    }
}

// Every cuDNN call needs the library bound first: the frontend keeps the first address it
// resolves for each entry point, so a call before pg_cudnn_init would fail for good.
void require_init() {
    require(fe::cudnn_dlhandle != nullptr, "pg_cudnn_init has not bound libcudnn");
}

// Checks a descriptor against what the graphs below assume.
void validate(const pg_sdpa_desc &d) {
    for (int32_t flag : {d.backward, d.causal, d.ragged, d.deterministic}) {
        require(flag == 0 || flag == 1, "backward, causal, ragged and deterministic must be 0 or 1");
    }
    require(d.b > 0 && d.h > 0 && d.h_kv > 0 && d.s > 0 && d.d > 0, "b, h, h_kv, s and d must be positive");
    require(d.h % d.h_kv == 0, "h_kv must divide h");
    require(d.max_total >= 0, "max_total must not be negative");
    require(d.ragged || d.max_total == 0, "max_total is for ragged graphs only");
    require(std::isfinite(d.scale), "scale must be finite");
}

// A tensor the graph reads (or, set_output, writes) with the descriptor's element strides.
Tensor tensor(fe::graph::Graph &g, Uid uid, const char *name, std::vector<int64_t> dim, const int64_t stride[4],
              fe::DataType_t type) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_uid(uid)
                        .set_name(name)
                        .set_dim(std::move(dim))
                        .set_stride({stride[0], stride[1], stride[2], stride[3]})
                        .set_data_type(type));
}

// An int32 index tensor of n entries, (n, 1, 1, 1): sequence lengths or ragged offsets.
Tensor index(fe::graph::Graph &g, Uid uid, const char *name, int64_t n) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_uid(uid)
                        .set_name(name)
                        .set_dim({n, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(fe::DataType_t::INT32));
}

// Marks a node's result as a graph output stored with the descriptor's strides.
void output(Tensor const &t, Uid uid, std::vector<int64_t> dim, const int64_t stride[4], fe::DataType_t type) {
    t->set_output(true)
        .set_uid(uid)
        .set_dim(std::move(dim))
        .set_stride({stride[0], stride[1], stride[2], stride[3]})
        .set_data_type(type);
}

// The options both directions share: scale, causal mask, and the ragged layout's lengths.
template <class Attributes>
void common_options(fe::graph::Graph &g, const pg_sdpa_desc &d, Attributes &opts) {
    opts.set_attn_scale(d.scale);
    if (d.causal) {
        opts.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    }
    if (d.ragged) {
        opts.set_padding_mask(true)
            .set_seq_len_q(index(g, UID_SEQ_LEN_Q, "seq_len_q", d.b))
            .set_seq_len_kv(index(g, UID_SEQ_LEN_KV, "seq_len_kv", d.b));
        if (d.max_total > 0) {
            // Bounds the packed token axis (and the backward's workspace) by the real total.
            opts.set_max_total_seq_len_q(d.max_total).set_max_total_seq_len_kv(d.max_total);
        }
    }
}

// The forward graph: O and Stats from Q, K, V.
void build_forward(fe::graph::Graph &g, const pg_sdpa_desc &d) {
    auto const bf16 = fe::DataType_t::BFLOAT16;
    auto q = tensor(g, UID_Q, "q", {d.b, d.h, d.s, d.d}, d.q, bf16);
    auto k = tensor(g, UID_K, "k", {d.b, d.h_kv, d.s, d.d}, d.k, bf16);
    auto v = tensor(g, UID_V, "v", {d.b, d.h_kv, d.s, d.d}, d.v, bf16);
    auto opts = fe::graph::SDPA_attributes().set_name("sdpa_forward").set_generate_stats(true);
    common_options(g, d, opts);
    if (d.ragged) {
        q->set_ragged_offset(index(g, UID_OFF_Q, "off_q", d.b + 1));
        k->set_ragged_offset(index(g, UID_OFF_K, "off_k", d.b + 1));
        v->set_ragged_offset(index(g, UID_OFF_V, "off_v", d.b + 1));
    }
    auto [o, stats] = g.sdpa(q, k, v, opts);
    output(o, UID_O, {d.b, d.h, d.s, d.d}, d.o, bf16);
    output(stats, UID_STATS, {d.b, d.h, d.s, 1}, d.stats, fe::DataType_t::FLOAT);
    if (d.ragged) {
        o->set_ragged_offset(index(g, UID_OFF_O, "off_o", d.b + 1));
        stats->set_ragged_offset(index(g, UID_OFF_STATS, "off_stats", d.b + 1));
    }
}

// The backward graph: dQ, dK, dV from Q, K, V, O, dO and the forward's Stats.
void build_backward(fe::graph::Graph &g, const pg_sdpa_desc &d) {
    auto const bf16 = fe::DataType_t::BFLOAT16;
    auto q = tensor(g, UID_Q, "q", {d.b, d.h, d.s, d.d}, d.q, bf16);
    auto k = tensor(g, UID_K, "k", {d.b, d.h_kv, d.s, d.d}, d.k, bf16);
    auto v = tensor(g, UID_V, "v", {d.b, d.h_kv, d.s, d.d}, d.v, bf16);
    auto o = tensor(g, UID_O, "o", {d.b, d.h, d.s, d.d}, d.o, bf16);
    auto dout = tensor(g, UID_DO, "do", {d.b, d.h, d.s, d.d}, d.o, bf16);
    auto stats = tensor(g, UID_STATS, "stats", {d.b, d.h, d.s, 1}, d.stats, fe::DataType_t::FLOAT);
    auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_deterministic_algorithm(
        d.deterministic != 0);
    common_options(g, d, opts);
    if (d.ragged) {
        q->set_ragged_offset(index(g, UID_OFF_Q, "off_q", d.b + 1));
        k->set_ragged_offset(index(g, UID_OFF_K, "off_k", d.b + 1));
        v->set_ragged_offset(index(g, UID_OFF_V, "off_v", d.b + 1));
        auto off_o = index(g, UID_OFF_O, "off_o", d.b + 1);
        o->set_ragged_offset(off_o);
        dout->set_ragged_offset(off_o);
        stats->set_ragged_offset(index(g, UID_OFF_STATS, "off_stats", d.b + 1));
    }
    auto [dq, dk, dv] = g.sdpa_backward(q, k, v, o, dout, stats, opts);
    output(dq, UID_DQ, {d.b, d.h, d.s, d.d}, d.dq, bf16);
    output(dk, UID_DK, {d.b, d.h_kv, d.s, d.d}, d.dk, bf16);
    output(dv, UID_DV, {d.b, d.h_kv, d.s, d.d}, d.dv, bf16);
    if (d.ragged) {
        dq->set_ragged_offset(index(g, UID_OFF_DQ, "off_dq", d.b + 1));
        dk->set_ragged_offset(index(g, UID_OFF_DK, "off_dk", d.b + 1));
        dv->set_ragged_offset(index(g, UID_OFF_DV, "off_dv", d.b + 1));
    }
}

// The variant pack of one execution: each tensor id of the graph to its buffer.
std::unordered_map<int64_t, void *> variant_pack(const pg_sdpa_desc &d, const pg_sdpa_ptrs &p) {
    std::unordered_map<int64_t, void *> pack;
    pack.reserve(20);
    auto put = [&pack](Uid uid, void *ptr, const char *name) {
        if (ptr == nullptr) {
            throw std::runtime_error(std::string("the graph needs `") + name + "`, which is NULL");
        }
        pack.emplace(uid, ptr);
    };
    put(UID_Q, p.q, "q");
    put(UID_K, p.k, "k");
    put(UID_V, p.v, "v");
    put(UID_O, p.o, "o");
    put(UID_STATS, p.stats, "stats");
    if (d.backward) {
        put(UID_DO, p.dout, "dout");
        put(UID_DQ, p.dq, "dq");
        put(UID_DK, p.dk, "dk");
        put(UID_DV, p.dv, "dv");
    }
    if (d.ragged) {
        put(UID_SEQ_LEN_Q, p.seq_len_q, "seq_len_q");
        put(UID_SEQ_LEN_KV, p.seq_len_kv, "seq_len_kv");
        put(UID_OFF_Q, p.off_q, "off_q");
        put(UID_OFF_K, p.off_k, "off_k");
        put(UID_OFF_V, p.off_v, "off_v");
        put(UID_OFF_O, p.off_o, "off_o");
        put(UID_OFF_STATS, p.off_stats, "off_stats");
        if (d.backward) {
            put(UID_OFF_DQ, p.off_dq, "off_dq");
            put(UID_OFF_DK, p.off_dk, "off_dk");
            put(UID_OFF_DV, p.off_dv, "off_dv");
        }
    }
    return pack;
}

}  // namespace

extern "C" {

int pg_cudnn_init(void *dlhandle, int64_t *version, char *err, size_t err_len) {
    if (version != nullptr) {
        *version = 0;
    }
    return guarded("pg_cudnn_init", err, err_len, [&] {
        require(dlhandle != nullptr, "no library handle");
        // The frontend keeps the entry points it resolved: one library per process.
        require(fe::cudnn_dlhandle == nullptr || fe::cudnn_dlhandle == dlhandle,
                "already bound to another libcudnn handle");
        // Looked up here rather than through the frontend, which would keep the address of a
        // library refused below.
        dlerror();
        auto get_version = reinterpret_cast<size_t (*)()>(dlsym(dlhandle, "cudnnGetVersion"));
        if (get_version == nullptr) {
            const char *why = dlerror();
            throw std::runtime_error(std::string("cudnnGetVersion not found: ") + (why ? why : "no such symbol"));
        }
        size_t const found = get_version();
        if (found / 10000 != 9) {
            throw std::runtime_error("cuDNN " + std::to_string(found) + " found; this build needs cuDNN 9 (built with " +
                                     std::to_string(CUDNN_VERSION) + "'s headers)");
        }
        fe::cudnn_dlhandle = dlhandle;
        if (version != nullptr) {
            *version = static_cast<int64_t>(found);
        }
        return 0;
    });
}

int pg_cudnn_handle_create(void *stream, void **handle, char *err, size_t err_len) {
    if (handle != nullptr) {
        *handle = nullptr;
    }
    return guarded("pg_cudnn_handle_create", err, err_len, [&] {
        require(handle != nullptr, "no place for the handle");
        require_init();
        cudnnHandle_t h = nullptr;
        check_cudnn(fe::detail::create_handle(&h), "cudnnCreate");
        cudnnStatus_t const status = fe::detail::set_stream(h, static_cast<cudaStream_t>(stream));
        if (status != CUDNN_STATUS_SUCCESS) {
            fe::detail::destroy_handle(h);
            check_cudnn(status, "cudnnSetStream");
        }
        *handle = h;
        return 0;
    });
}

void pg_cudnn_handle_destroy(void *handle) {
    try {
        if (handle != nullptr && fe::cudnn_dlhandle != nullptr) {
            (void)fe::detail::destroy_handle(static_cast<cudnnHandle_t>(handle));
        }
    } catch (...) {
        // Nothing to report to: a handle that cannot be destroyed is leaked.
    }
}

int pg_sdpa_build(void *handle, const pg_sdpa_desc *desc, void **graph, int64_t *workspace_bytes, char *err,
                  size_t err_len) {
    if (graph != nullptr) {
        *graph = nullptr;
    }
    if (workspace_bytes != nullptr) {
        *workspace_bytes = 0;
    }
    return guarded("pg_sdpa_build", err, err_len, [&] {
        require(handle != nullptr && desc != nullptr && graph != nullptr && workspace_bytes != nullptr,
                "handle, desc, graph and workspace_bytes must not be NULL");
        require_init();
        validate(*desc);
        auto built = std::make_unique<SdpaGraph>();
        built->desc = *desc;
        auto &g = built->graph;
        g.set_io_data_type(fe::DataType_t::BFLOAT16)
            .set_intermediate_data_type(fe::DataType_t::FLOAT)
            .set_compute_data_type(fe::DataType_t::FLOAT);
        if (desc->backward) {
            build_backward(g, *desc);
        } else {
            build_forward(g, *desc);
        }
        // Checks the attributes, lowers to cuDNN's operation graph on the handle's device, asks
        // the heuristics for engines (mode A, then the fallback list), keeps the supported ones
        // and compiles the first that builds.
        check(g.validate(), "validate");
        check(g.build_operation_graph(static_cast<cudnnHandle_t>(handle)), "build_operation_graph");
        check(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_execution_plans");
        check(g.check_support(), "check_support");
        check(g.build_plans(), "build_plans");
        int64_t bytes = 0;
        check(g.get_workspace_size(bytes), "get_workspace_size");
        *workspace_bytes = bytes;
        *graph = built.release();
        return 0;
    });
}

int pg_sdpa_execute(void *handle, void *graph, const pg_sdpa_ptrs *ptrs, void *workspace, char *err,
                    size_t err_len) {
    return guarded("pg_sdpa_execute", err, err_len, [&] {
        require(handle != nullptr && graph != nullptr && ptrs != nullptr, "handle, graph and ptrs must not be NULL");
        auto const &built = *static_cast<SdpaGraph *>(graph);
        auto pack = variant_pack(built.desc, *ptrs);
        // Queues the kernels (and the frontend's workspace memsets) on the handle's stream.
        check(built.graph.execute(static_cast<cudnnHandle_t>(handle), pack, workspace), "execute");
        return 0;
    });
}

void pg_sdpa_destroy(void *graph) {
    delete static_cast<SdpaGraph *>(graph);
}

}  // extern "C"
