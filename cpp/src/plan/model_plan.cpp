// make_plan (the bandwidth, endurance and micro-batch report) and
// communication (Note [Collective time]).
#include "ebbtide/plan/model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ebbtide/util/error.hpp"

namespace ebbtide::plan {

namespace {

// Largest b with b * per_sample <= budget (0 when nothing fits).
int64_t fit(double budget, double per_sample) {
  if (budget <= 0 || per_sample <= 0) return 0;
  const double n = std::floor(budget / per_sample);
  return n > 1e15 ? static_cast<int64_t>(1e15) : static_cast<int64_t>(n);
}

}  // namespace

PlanReport make_plan(const ModelConfig& config, const GpuSpec& gpu, const SsdSpec& ssd,
                     const PlanOptions& options) {
  validate(config);
  EBB_CHECK(options.mfu > 0 && options.mfu <= 1, "plan setting 'mfu' must be in (0, 1], got ",
            options.mfu);
  EBB_CHECK(options.ssds > 0, "plan setting 'ssds' must be a positive integer, got ", options.ssds);
  EBB_CHECK(options.write_amplification >= 1.0,
            "plan setting 'write_amplification' must be >= 1.0, got ", options.write_amplification);

  PlanReport r;
  r.config = config;
  r.gpu = gpu;
  r.ssd = ssd;
  r.options = options;
  const double t = static_cast<double>(config.tp);
  r.params = parameter_count(config);
  r.units = parameter_units(config);
  r.model_state = model_state_bytes(r.units, options.sharding);
  r.model_state_bytes = r.model_state.total;
  r.activations = activation_bytes(config);
  r.offloaded_bytes_per_step =
      std::max(0.0, r.activations.per_step - r.activations.last_layer - r.activations.shared);
  r.resident_bytes_offloaded = r.activations.last_layer + r.activations.shared + r.activations.logits +
                               r.activations.outside + r.activations.recompute_layer;
  r.flops = flops(config);

  const double peak = (config.bytes_per_element == 4 ? gpu.peak_tf32_tflops : gpu.peak_bf16_tflops) * 1e12;
  const double rate = peak * options.mfu;
  r.forward_seconds = r.flops.forward / t / rate;
  r.step_seconds = r.flops.step / t / rate;

  const double ssds = static_cast<double>(options.ssds);
  r.required_write_gbps = r.offloaded_bytes_per_step / (r.step_seconds / 2) / 1e9;
  r.ssd_write_gbps = ssd.seq_write_gbps * ssds;
  r.ssd_read_gbps = ssd.seq_read_gbps * ssds;
  r.write_gbps_available = std::min(r.ssd_write_gbps, gpu.pcie_gbps);
  r.bandwidth_sufficient = r.required_write_gbps <= r.write_gbps_available;
  const double write_seconds = r.offloaded_bytes_per_step / (r.write_gbps_available * 1e9);
  r.step_seconds_with_offload = std::max(r.step_seconds, 2 * write_seconds);
  r.bytes_written_per_second =
      r.offloaded_bytes_per_step * options.write_amplification / r.step_seconds_with_offload;
  const double endurance = ssd.pbw * 1e15 * ssds;
  constexpr double kSecondsPerYear = 365.25 * 86400.0;
  r.ssd_lifetime_years = r.bytes_written_per_second > 0
                             ? endurance / r.bytes_written_per_second / kSecondsPerYear
                             : std::numeric_limits<double>::infinity();
  r.ssd_capacity_bytes = ssd.capacity_tb * 1e12 * ssds;
  r.gpu_memory_bytes = gpu.memory_gb * 1e9;

  // Every activation term is affine in the micro-batch (a few, such as
  // position tables, do not grow with it): size one and two samples, fit
  // per sample in what the fixed part leaves.
  ModelConfig one = config;
  one.batch = 1;
  ModelConfig two = config;
  two.batch = 2;
  const ActivationBytes a1 = activation_bytes(one);
  const ActivationBytes a2 = activation_bytes(two);
  const double free_gpu = r.gpu_memory_bytes - r.model_state_bytes;
  auto resident = [](const ActivationBytes& a) {
    return a.last_layer + a.shared + a.logits + a.outside + a.recompute_layer;
  };
  auto kept = [](const ActivationBytes& a) { return a.per_step + a.logits + a.outside + a.recompute_layer; };
  auto offloaded = [](const ActivationBytes& a) { return std::max(0.0, a.per_step - a.last_layer - a.shared); };
  auto fit_affine = [](double budget, double at1, double at2) { return fit(budget - (2 * at1 - at2), at2 - at1); };
  const int64_t by_gpu = fit_affine(free_gpu, resident(a1), resident(a2));
  const int64_t by_ssd =
      offloaded(a1) > 0 ? fit_affine(r.ssd_capacity_bytes, offloaded(a1), offloaded(a2)) : by_gpu;
  r.max_micro_batch = std::min(by_gpu, by_ssd);
  r.max_micro_batch_without_offload = fit_affine(free_gpu, kept(a1), kept(a2));
  return r;
}

// Note [Collective time]: a ring collective over n GPUs moves (n-1)/n of
// the full buffer through each link of the ring in n-1 steps: (n-1)/n x
// bytes / bw + (n-1) x latency. Inside a node bw is a GPU's NVLink rate.
// Across nodes it depends on who shares the NICs: a ring that all of a
// node's GPUs join (FSDP's shard group, DDP's all-reduce) enters and leaves
// each node once per channel, and NCCL spreads its channels over all the
// node's NICs, so it runs at the node's aggregate rate (gpus_per_node x
// inter_gbps, at most NVLink); HSDP's replica all-reduces (one GPU per node
// in each, all of a node's GPUs at once) get a GPU's share. Stage 3
// all-gathers each layer before its forward and again before its backward,
// and reduce-scatters its gradients after backward (HSDP: then all-reduces
// the shard across the dp / N replicas); a layer's collectives overlap the
// neighbouring layer's compute, so what exceeds the layer's compute is
// exposed, layer kind by layer kind (an encoder-decoder's decoder layers are
// larger and longer than its encoder layers), and the root unit's gather
// (before the first layer) and reduce-scatter (after the last) are exposed
// whole. Stages 0-2 all-reduce (2: reduce-scatter) the gradients in buckets
// during backward, exposed beyond the backward time; stages 1-2 all-gather
// the updated parameters after the optimizer step, exposed.
CommTimes communication(const PlanReport& r, const NetworkSpec& net) {
  EBB_CHECK(net.gpus_per_node > 0 && net.intra_gbps > 0 && net.inter_gbps > 0 && net.latency_us >= 0,
            "network '", net.name, "' needs positive GPUs per node and rates, and latency >= 0");
  const ShardingOptions& o = r.options.sharding;
  const double node_gbps = std::min(net.intra_gbps, net.inter_gbps * static_cast<double>(net.gpus_per_node));
  auto ring = [&](double bytes, int64_t n, bool one_gpu_per_node) {
    if (n <= 1) return 0.0;
    const double gbps = one_gpu_per_node ? net.inter_gbps : (n > net.gpus_per_node ? node_gbps : net.intra_gbps);
    const double k = static_cast<double>(n);
    return (k - 1) / k * bytes / (gbps * 1e9) + (k - 1) * net.latency_us * 1e-6;
  };
  CommTimes c;
  const double t = static_cast<double>(r.config.tp);
  const double rate = r.flops.forward / t / r.forward_seconds;  // FLOP/s per GPU
  const double backward_ratio = (r.step_seconds - r.forward_seconds) / r.forward_seconds;
  const double backward = r.step_seconds - r.forward_seconds;
  const int64_t n = r.model_state.shard_over;
  const int64_t replicas = o.dp / n;
  if (o.zero_stage == 3) {
    auto reduce = [&](double params) {
      return ring(o.grad_bytes * params, n, false) +
             2 * ring(o.grad_bytes * params / static_cast<double>(n), replicas, true);
    };
    struct LayerKind {
      double count, params, flops;
    };
    const LayerKind kinds[] = {
        {static_cast<double>(r.config.self_only_layers()), r.units.self_layer, r.flops.self_layer / t},
        {static_cast<double>(r.config.cross_layers()), r.units.cross_layer, r.flops.cross_layer / t},
    };
    for (const LayerKind& kind : kinds) {
      if (kind.count <= 0) continue;
      const double forward = kind.flops / rate;
      const double gather = ring(o.param_bytes * kind.params, n, false);
      const double reduced = reduce(kind.params);
      c.comm_seconds += kind.count * (2 * gather + reduced);
      c.exposed_seconds += kind.count * (std::max(0.0, gather - forward) +
                                         std::max(0.0, gather + reduced - forward * backward_ratio));
      if (kind.params >= r.units.largest_layer) {  // report the largest layer's times
        c.gather_seconds = gather;
        c.reduce_seconds = reduced;
        c.unit_forward_seconds = forward;
        c.unit_backward_seconds = forward * backward_ratio;
      }
    }
    const double root = ring(o.param_bytes * r.units.root, n, false) + reduce(r.units.root);
    c.comm_seconds += root;
    c.exposed_seconds += root;
  } else {
    const double layer_flops = r.flops.largest_layer() / t;
    c.unit_forward_seconds = layer_flops / rate;
    c.unit_backward_seconds = c.unit_forward_seconds * backward_ratio;
    const double grads = o.grad_bytes * r.units.total;
    const double reduce = o.zero_stage == 2 ? ring(grads, n, false) + 2 * ring(grads / static_cast<double>(n),
                                                                               replicas, true)
                                            : 2 * ring(grads, o.dp, false);
    const double gather = o.zero_stage >= 1 ? ring(o.param_bytes * r.units.total, n, false) : 0.0;
    c.comm_seconds = reduce + gather;
    c.exposed_seconds = std::max(0.0, reduce - backward) + gather;
  }
  c.step_seconds = r.step_seconds + c.exposed_seconds;
  c.scaling_efficiency = r.step_seconds / c.step_seconds;
  return c;
}

}  // namespace ebbtide::plan
