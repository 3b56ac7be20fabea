// gradcomp._C: thin bindings of the C++ core for the Python package (python/gradcomp/). The
// logic lives in C++ (the engine, DistributedGradients); the Python side adds the optimizer
// wrapper and the DDP hook. Every blocking call releases the GIL.
#include <pybind11/functional.h>
#include <torch/extension.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <span>

#include "gradcomp/codec.h"
#include "gradcomp/engine.h"
#include "gradcomp/error.h"
#include "gradcomp/feedback.h"
#include "gradcomp/optimizer.h"
#include "gradcomp/option.h"
#include "gradcomp/plan.h"
#include "gradcomp/recommended.h"
#include "gradcomp/scheduler.h"
#include "gradcomp/server.h"
#include "gradcomp/torch/blas_threads.h"
#include "gradcomp/torch/distributed_gradients.h"
#include "gradcomp/torch/process_group_transport.h"
#include "gradcomp/torch/sparse_rows.h"
#include "gradcomp/transport.h"

namespace py = pybind11;
using namespace gradcomp;
namespace gt = gradcomp::torch;

namespace {

Milliseconds seconds(double s) { return Milliseconds(static_cast<int64_t>(s * 1000.0)); }

EngineOptions engine_options(uint64_t seed, const std::string& timeline, int local_size,
                             int codec_threads) {
  EngineOptions o;
  o.seed = seed;
  o.timeline = timeline;
  o.local_size = local_size;
  o.codec_threads = codec_threads;
  return o;
}

py::dict step_stats(const StepStats& s) {
  py::dict d;
  d["step"] = s.step;
  d["bytes_sent"] = s.bytes_sent;
  d["uncompressed_bytes"] = s.uncompressed_bytes;
  d["step_seconds"] = s.step_seconds;
  d["exchange_seconds"] = s.exchange_seconds;
  d["finite"] = s.finite;
  return d;
}

py::bytes to_bytes(const std::vector<std::byte>& state) {
  return py::bytes(reinterpret_cast<const char*>(state.data()), state.size());
}

// Every rank's state (Engine::save_all_states, a collective) as a list of bytes; the GIL is
// released meanwhile, since other threads may need it.
template <class F>
py::list all_states(F&& save_all) {
  std::vector<std::vector<std::byte>> states;
  {
    py::gil_scoped_release release;
    states = save_all();
  }
  py::list out;
  for (const auto& s : states) out.append(to_bytes(s));
  return out;
}

std::span<const std::byte> as_span(const std::string& bytes) {
  return {reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()};
}

std::span<float> float_span(const at::Tensor& t, const std::string& what) {
  if (t.scalar_type() != at::kFloat || !t.is_contiguous() || !t.device().is_cpu() ||
      t.is_sparse()) {
    throw Error(what + " must be a contiguous float32 CPU tensor");
  }
  return {t.data_ptr<float>(), static_cast<size_t>(t.numel())};
}

// The bytes of a dense contiguous CPU tensor of any type (broadcast copies bytes exactly).
std::span<std::byte> byte_span(const at::Tensor& t, const std::string& what) {
  if (!t.is_contiguous() || !t.device().is_cpu() || t.is_sparse()) {
    throw Error(what + " must be a dense contiguous CPU tensor");
  }
  return {static_cast<std::byte*>(t.data_ptr()),
          static_cast<size_t>(t.numel()) * static_cast<size_t>(t.element_size())};
}

// A Python-owned engine over caller tensors (the DDP hook's buckets).
class PyEngine {
 public:
  PyEngine(std::shared_ptr<Transport> transport, const std::string& plan_json, uint64_t seed,
           const std::string& timeline, int local_size, int codec_threads)
      : engine_(std::move(transport), Plan::parse(plan_json),
                engine_options(seed, timeline, local_size, codec_threads)) {}
  void ready(size_t index, const at::Tensor& grad) {
    tensors_.push_back(grad);  // kept alive until synchronize() has written into it
    engine_.ready(index, float_span(grad, "a gradient"));
  }
  void synchronize() {
    engine_.synchronize();
    tensors_.clear();
  }
  Engine& engine() { return engine_; }

 private:
  Engine engine_;
  std::vector<at::Tensor> tensors_;
};

void register_errors(py::module_& m) {
  static py::exception<Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<SpecError> spec_error(m, "SpecError", error.ptr());
  static py::exception<CommError> comm_error(m, "CommError", error.ptr());
  static py::exception<TimeoutError> timeout_error(m, "TimeoutError", comm_error.ptr());
  // Most derived first: a TimeoutError is also a CommError and an Error.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      timeout_error(e.what());
    } catch (const CommError& e) {
      comm_error(e.what());
    } catch (const SpecError& e) {
      spec_error(e.what());
    } catch (const Error& e) {
      error(e.what());
    }
  });
}

py::dict recommendation_dict(const Recommendation& r) {
  return py::dict(py::arg("codec") = r.codec, py::arg("option") = r.option,
                  py::arg("sgd") = r.sgd, py::arg("adam") = r.adam,
                  py::arg("changes_optimizer") = r.changes_optimizer,
                  py::arg("lans") = r.lans.empty() ? py::object(py::none()) : py::str(r.lans),
                  py::arg("recommended") = recommended(r));
}

OptimizerFamily optimizer_family(const std::string& name) {
  if (name == "sgd") return OptimizerFamily::kSgd;
  if (name == "adam") return OptimizerFamily::kAdam;
  if (name == "lans") return OptimizerFamily::kLans;
  throw Error("optimizer family '" + name + "' is unknown; use 'sgd', 'adam' or 'lans'");
}

LayerSlot layer_slot(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq) {
  return {float_span(param, "param"),
          grad.defined() ? float_span(grad, "grad") : std::span<float>{},
          float_span(exp_avg, "exp_avg"), float_span(exp_avg_sq, "exp_avg_sq")};
}

// A kernel of gradcomp/optimizer.h as Python calls it: (param, grad, exp_avg, exp_avg_sq, step,
// hyper, threads, *extra), in place on contiguous float32 CPU tensors, without the GIL.
template <typename... Extra, typename Kernel>
auto on_layer(Kernel kernel) {
  return [kernel](const at::Tensor& param, const std::optional<at::Tensor>& grad,
                  const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t step,
                  const AdamHyper& h, int threads, Extra... extra) {
    const LayerSlot layer = layer_slot(param, grad.value_or(at::Tensor()), exp_avg, exp_avg_sq);
    py::gil_scoped_release release;
    return kernel(layer, step, h, threads, extra...);
  };
}

// The optimizers' kernels on one layer, for python/gradcomp/optimizers.py and onebit_adam.py.
void bind_optimizer_kernels(py::module_& m) {
  py::class_<AdamHyper>(m, "AdamHyper")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay,
                       bool bias_correction) {
             return AdamHyper{.lr = lr,
                              .beta1 = beta1,
                              .beta2 = beta2,
                              .eps = eps,
                              .weight_decay = weight_decay,
                              .bias_correction = bias_correction};
           }),
           py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("bias_correction") = true)
      .def(
          "check",
          [](const AdamHyper& h, const std::string& optimizer) { check_adam_hyper(h, optimizer); },
          "Raises SpecError naming the first hyper-parameter out of range.");
  py::class_<LayerStep>(m, "LayerStep")
      .def_readonly("param_norm", &LayerStep::param_norm)
      .def_readonly("trust_ratio", &LayerStep::trust_ratio)
      .def_readonly("grad_trust", &LayerStep::grad_trust);
  m.def("lamb_step", on_layer([](const LayerSlot& l, int64_t s, const AdamHyper& h, int t) {
          return lamb_step(l, s, h, t);
        }),
        "One LAMB step on one layer; returns a LayerStep.");
  m.def("lans_step",
        on_layer<bool>([](const LayerSlot& l, int64_t s, const AdamHyper& h, int t,
                          bool normalize) { return lans_step(l, s, h, normalize, t); }),
        "One LANS step on one layer (the last argument: normalize_grad); returns a LayerStep.");
  m.def("adamw_step", on_layer([](const LayerSlot& l, int64_t s, const AdamHyper& h, int t) {
          adamw_step(l, s, h, t);
        }),
        "One AdamW step on one layer (1-bit Adam's warm-up).");
  m.def("frozen_adam_step",
        on_layer<int64_t>([](const LayerSlot& l, int64_t s, const AdamHyper& h, int t,
                             int64_t frozen_at) { frozen_adam_step(l, s, frozen_at, h, t); }),
        "1-bit Adam's compression-stage step on one layer (grad None; the last argument: the "
        "step the variance froze at).");
  py::class_<OneBitLambHyper>(m, "OneBitLambHyper")
      .def(py::init([](double coeff_beta, double max_coeff, double min_coeff, double factor_max,
                       double factor_min, double factor_threshold) {
             return OneBitLambHyper{.coeff_beta = coeff_beta,
                                    .max_coeff = max_coeff,
                                    .min_coeff = min_coeff,
                                    .factor_max = factor_max,
                                    .factor_min = factor_min,
                                    .factor_threshold = factor_threshold};
           }),
           py::arg("coeff_beta"), py::arg("max_coeff"), py::arg("min_coeff"),
           py::arg("factor_max"), py::arg("factor_min"), py::arg("factor_threshold"))
      .def(
          "check",
          [](const OneBitLambHyper& h, const std::string& optimizer) {
            check_onebit_lamb_hyper(h, optimizer);
          },
          "Raises SpecError naming the first knob out of range.");
  m.def("onebit_lamb_step",
        on_layer<const at::Tensor&, int64_t, double, double, const OneBitLambHyper&>(
            [](const LayerSlot& l, int64_t s, const AdamHyper& h, int t, const at::Tensor& fresh,
               int64_t frozen_at, double coeff, double factor, const OneBitLambHyper& lh) {
              OneBitLambLayer state{coeff, factor, float_span(fresh, "fresh_exp_avg_sq")};
              const LayerStep step = onebit_lamb_step(l, state, s, frozen_at, h, lh, t);
              return std::make_pair(step, state.factor);
            }),
        "1-bit LAMB's compression-stage step on one layer (grad: this step's averaged momentum; "
        "then the fresh variance, the variance's number of updates, the frozen coefficient, the "
        "last factor and the knobs); returns (LayerStep, the new factor).");
  m.def("zero_one_adam_step",
        on_layer<int64_t, bool>([](const LayerSlot& l, int64_t s, const AdamHyper& h, int t,
                                   int64_t updates, bool update_variance) {
          zero_one_adam_step(l, s, updates, update_variance, h, t);
        }),
        "0/1 Adam's step on one layer (the last arguments: the variance's number of updates, "
        "this one included, and whether this step updates it).");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gradcomp's C++ core (use the gradcomp and gradcomp.torch modules)";
  register_errors(m);
  bind_optimizer_kernels(m);

  m.def("codec_names", &codec_names);
  m.def("recommendations", [] {
    py::list out;
    for (const auto& r : recommendations()) out.append(recommendation_dict(r));
    return out;
  });
  m.def("recommended_options", [](const std::string& family) {
    return recommended_options({optimizer_family(family)});
  });
  m.def("recommendation_warning",
        [](const std::string& option, const std::string& family, const std::string& optimizer) {
          return recommendation_warning(option, optimizer_family(family), optimizer);
        });
  m.def("codec_uses_layout",
        [](const std::string& spec) { return make_codec(spec)->traits().uses_layout; });
  m.def(
      "sparse_rows_mean",
      [](std::shared_ptr<Transport> transport, const std::string& name, const at::Tensor& grad) {
        gt::SparseMean mean;
        {
          py::gil_scoped_release release;
          mean = gt::sparse_rows_mean(*transport, name, grad, grad);
        }
        return py::make_tuple(mean.grad, mean.bytes_sent);
      },
      py::arg("transport"), py::arg("name"), py::arg("grad"),
      "The mean over ranks of a sparse gradient, exchanged as rows (a collective); returns "
      "(coalesced sparse mean, bytes this rank sent).");
  m.def("feedback_names", &feedback_names);
  m.def("route_names", &route_names);
  m.def("transport_names", &transport_names);
  m.def(
      "stop_servers",
      [] {
        py::gil_scoped_release release;
        stop_servers();
      },
      "Tells the job's parameter servers (route 'servers') to end now: a collective of the "
      "workers, with no optimizer using them alive. It happens by itself at exit.");
  m.def("parse_option", [](const std::string& text) {
    const Option o = parse_option(text);
    return py::make_tuple(o.codec, o.feedback, o.route, o.start_step);
  });
  m.def(
      "default_plan",
      [](const std::vector<std::pair<std::string, size_t>>& tensors,
         const std::string& compression, size_t bucket_bytes, size_t min_compress_elements) {
        std::vector<TensorInfo> infos;
        for (const auto& [name, n] : tensors) infos.push_back({name, n});
        DefaultPlanSettings settings;
        settings.bucket_bytes = bucket_bytes;
        settings.min_compress_elements = min_compress_elements;
        settings.compressed = parse_option(compression);
        return make_default_plan(std::move(infos), settings).to_json().dump();
      },
      py::arg("tensors"), py::arg("compression"), py::arg("bucket_bytes"),
      py::arg("min_compress_elements"));
  m.def(
      "bucketed_plan",
      [](const std::vector<std::vector<std::tuple<std::string, size_t, std::vector<size_t>>>>& buckets,
         const std::string& compression, size_t min_compress_elements) {
        std::vector<std::vector<TensorInfo>> infos(buckets.size());
        for (size_t b = 0; b < buckets.size(); ++b) {
          for (const auto& [name, n, shape] : buckets[b]) infos[b].push_back({name, n, shape});
        }
        DefaultPlanSettings settings;
        settings.min_compress_elements = min_compress_elements;
        settings.compressed = parse_option(compression);
        return make_bucketed_plan(infos, settings).to_json().dump();
      },
      py::arg("buckets"), py::arg("compression"), py::arg("min_compress_elements"),
      "The plan of given buckets (per bucket: (name, elements, shape) of its tensors), each "
      "compressed when it holds at least min_compress_elements elements (make_bucketed_plan).");
  m.def("validate_plan", [](const std::string& json) {
    return Plan::parse(json).to_json().dump();  // the error says where (parse position, field)
  });

  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport")
      .def_property_readonly("name", &Transport::name)
      .def_property_readonly("rank", &Transport::rank)
      .def_property_readonly("size", &Transport::size)
      .def(
          "allreduce_",
          [](Transport& t, const at::Tensor& tensor) {
            auto values = float_span(tensor, "the tensor");
            py::gil_scoped_release release;
            t.allreduce(values)->wait(t.timeout());
          },
          "Sums a float32 tensor over the ranks, in place (blocking).")
      .def(
          "broadcast_",
          [](Transport& t, const at::Tensor& tensor, int root) {
            auto bytes = byte_span(tensor, "the tensor");
            py::gil_scoped_release release;
            t.broadcast(bytes, root)->wait(t.timeout());
          },
          py::arg("tensor"), py::arg("root") = 0,
          "Copies root's tensor (any type, its bytes) into every rank's, in place (blocking).")
      .def("barrier", [](Transport& t) {
        py::gil_scoped_release release;
        t.barrier()->wait(t.timeout());
      });
  m.def(
      "make_transport",
      [](const std::string& backend, double timeout, const std::string& store, int rank,
         int world_size) -> std::shared_ptr<Transport> {
        TransportOptions options;
        options.backend = backend;
        options.timeout = seconds(timeout);
        options.store = store;
        options.rank = rank;
        options.world_size = world_size;
        py::gil_scoped_release release;
        return make_transport(options);
      },
      py::arg("backend") = "", py::arg("timeout") = 0.0, py::arg("store") = "",
      py::arg("rank") = -1, py::arg("world_size") = -1);
  m.def(
      "process_group_transport",
      [](c10::intrusive_ptr<c10d::ProcessGroup> group, const std::string& device,
         double timeout, c10::intrusive_ptr<c10d::Store> store) {
        return gt::make_process_group_transport(std::move(group), c10::Device(device),
                                                   seconds(timeout), std::move(store));
      },
      py::arg("group"), py::arg("device") = "cpu", py::arg("timeout") = 0.0,
      py::arg("store") = py::none());

  py::class_<gt::EndOfBackward>(m, "EndOfBackward",
                                "Finishes one backward pass: autograd calls it when the pass ends")
      .def("__call__", &gt::EndOfBackward::operator(), py::call_guard<py::gil_scoped_release>());
  m.def("transport_in_use", [](const Transport& t) { return gt::transport_in_use(t); });
  m.def("openblas_threads", &gt::openblas_threads,
        "The threads of the OpenBLAS loaded in this process; None for another BLAS or none");
  m.def("take_blas_threads_warning", &gt::take_blas_threads_warning,
        "The BLAS-thread warning at the first call of this process (empty if none), empty "
        "at every later one");

  py::class_<AutoSettings>(m, "AutoSettings", "compression=\"auto\": the scheduler's settings")
      .def(py::init<>())
      .def_readwrite("candidates", &AutoSettings::candidates)
      .def_readwrite("warmup_steps", &AutoSettings::warmup_steps)
      .def_readwrite("profile_steps", &AutoSettings::profile_steps)
      .def_readwrite("trial_steps", &AutoSettings::trial_steps)
      .def_readwrite("stop_after", &AutoSettings::stop_after)
      .def_readwrite("stop_margin", &AutoSettings::stop_margin)
      .def_readwrite("max_proposals", &AutoSettings::max_proposals)
      .def_readwrite("refine_proposals", &AutoSettings::refine_proposals)
      .def_readwrite("runoff", &AutoSettings::runoff)
      .def_readwrite("drift", &AutoSettings::drift)
      .def_readwrite("check_every", &AutoSettings::check_every)
      .def_readwrite("drift_checks", &AutoSettings::drift_checks)
      .def_readwrite("link_check_every", &AutoSettings::link_check_every)
      .def_readwrite("link_change", &AutoSettings::link_change)
      .def_readwrite("residual_growth", &AutoSettings::residual_growth)
      .def_readwrite("residual_checks", &AutoSettings::residual_checks)
      .def_readwrite("verbose", &AutoSettings::verbose)
      .def_readwrite("bucket_bytes", &AutoSettings::bucket_bytes)
      .def_readwrite("min_compress_elements", &AutoSettings::min_compress_elements)
      .def_readwrite("local_size", &AutoSettings::local_size)
      .def("validate", &AutoSettings::validate)
      .def_static(
          "from_json",
          [](const std::string& given, AutoSettings start) {
            const auto parsed = nlohmann::json::parse(given, nullptr, /*allow_exceptions=*/false);
            if (parsed.is_discarded()) {
              throw SpecError("auto: the settings are not JSON: " + given);
            }
            return AutoSettings::from_json(parsed, std::move(start));
          },
          "`start` with the settings a JSON object names (SpecError naming a bad one)");

  // compression="auto" for front ends that drive an Engine themselves (the DDP hook): times
  // in seconds of one monotonic clock (time.monotonic()).
  py::class_<AutoScheduler>(m, "AutoScheduler")
      .def(py::init([](std::shared_ptr<Transport> transport, const std::string& plan_json,
                       AutoSettings settings) {
             const Plan plan = Plan::parse(plan_json);
             return std::make_unique<AutoScheduler>(std::move(transport), plan.tensors,
                                                    std::move(settings));
           }),
           py::arg("transport"), py::arg("plan_json"), py::arg("settings"))
      .def("initial_plan", [](const AutoScheduler& a) { return a.initial_plan().to_json().dump(); })
      .def("watch",
           [](AutoScheduler& a, PyEngine& e) {
             Engine* engine = &e.engine();
             a.set_health_source({[engine] { engine->measure_mean_norms(); },
                                  [engine] { return engine->feedback_health(); }});
             // Searches and decisions on the engine's timeline (lane "compression=auto").
             a.set_event_sink([engine](const std::string& name, AutoScheduler::TimePoint start,
                                       AutoScheduler::TimePoint end, const nlohmann::json& args) {
               engine->timeline_event(name, start, end, args);
             });
           },
           py::keep_alive<1, 2>(),
           "read the feedback's health from this engine, and mark decisions on its timeline")
      .def("on_step_end",
           [](AutoScheduler& a, double step_start, double first_ready, double last_ready,
              double exchange_end, double step_end,
              std::vector<double> ready) -> std::optional<std::string> {
             const StepTimes times{step_start, first_ready, last_ready, exchange_end, step_end,
                                   std::move(ready)};
             std::optional<Plan> plan;
             {
               py::gil_scoped_release release;
               plan = a.on_step_end(times);
             }
             if (!plan) return std::nullopt;
             return plan->to_json().dump();
           })
      .def("in_trial", &AutoScheduler::in_trial,
           "whether the plan on_step_end returned last is a trial (Engine.set_plan's trial)")
      .def("report", [](const AutoScheduler& a) { return a.report().dump(); })
      .def("save", [](const AutoScheduler& a) { return a.save().dump(); })
      .def("restore", [](AutoScheduler& a, const std::string& saved) -> std::optional<std::string> {
        auto plan = a.restore(nlohmann::json::parse(saved));
        if (!plan) return std::nullopt;
        return plan->to_json().dump();
      });

  py::class_<gt::DistributedGradients>(m, "DistributedGradients")
      .def(py::init([](std::vector<std::pair<std::string, at::Tensor>> parameters,
                       std::shared_ptr<Transport> transport, const std::string& compression,
                       const std::string& plan_json, size_t bucket_bytes,
                       size_t min_compress_elements, int backward_passes_per_step,
                       uint64_t seed, const std::string& timeline, int local_size,
                       int codec_threads,
                       std::function<void(gt::EndOfBackward)> queue_end_of_backward,
                       bool find_unused_parameters, std::vector<std::string> sparse_parameters,
                       std::optional<AutoSettings> auto_settings) {
             gt::GradientOptions options;
             options.auto_settings = std::move(auto_settings);
             options.compression = parse_option(options.auto_settings ? "none" : compression);
             if (!plan_json.empty()) {
               options.plan = Plan::parse(plan_json);
             }
             options.bucket_bytes = bucket_bytes;
             options.min_compress_elements = min_compress_elements;
             options.backward_passes_per_step = backward_passes_per_step;
             options.find_unused_parameters = find_unused_parameters;
             options.sparse_parameters = std::move(sparse_parameters);
             options.engine = engine_options(seed, timeline, local_size, codec_threads);
             options.queue_end_of_backward = std::move(queue_end_of_backward);
             py::gil_scoped_release release;
             return std::make_unique<gt::DistributedGradients>(
                 std::move(parameters), std::move(transport), std::move(options));
           }),
           py::arg("parameters"), py::arg("transport"), py::arg("compression"),
           py::arg("plan_json"), py::arg("bucket_bytes"), py::arg("min_compress_elements"),
           py::arg("backward_passes_per_step"), py::arg("seed"), py::arg("timeline"),
           py::arg("local_size"), py::arg("codec_threads"),
           py::arg("queue_end_of_backward") = nullptr,
           py::arg("find_unused_parameters") = false,
           py::arg("sparse_parameters") = std::vector<std::string>{},
           py::arg("auto_settings") = std::nullopt)
      .def("auto_report",
           [](const gt::DistributedGradients& g) { return g.auto_report().dump(); })
      .def("save_auto", [](const gt::DistributedGradients& g) { return g.save_auto().dump(); })
      .def("load_auto",
           [](gt::DistributedGradients& g, const std::string& saved) {
             const auto parsed = nlohmann::json::parse(saved);
             py::gil_scoped_release release;
             g.load_auto(parsed);
           })
      .def("synchronize", &gt::DistributedGradients::synchronize,
           py::call_guard<py::gil_scoped_release>())
      .def("step_done", &gt::DistributedGradients::step_done,
           py::call_guard<py::gil_scoped_release>())
      .def("pending", &gt::DistributedGradients::pending)
      .def("aborted_step", &gt::DistributedGradients::aborted_step)
      .def("mean_is_finite", &gt::DistributedGradients::mean_is_finite)
      .def("set_plan",
           [](gt::DistributedGradients& g, const std::string& compression,
              const std::string& plan_json, size_t bucket_bytes, size_t min_compress_elements) {
             gt::GradientOptions options;
             options.compression = parse_option(compression);
             if (!plan_json.empty()) options.plan = Plan::parse(plan_json);
             options.bucket_bytes = bucket_bytes;
             options.min_compress_elements = min_compress_elements;
             py::gil_scoped_release release;
             g.set_plan(options);
           },
           py::arg("compression"), py::arg("plan_json"), py::arg("bucket_bytes"),
           py::arg("min_compress_elements"))
      .def("set_learning_rate", &gt::DistributedGradients::set_learning_rate)
      .def("set_loss_scale", &gt::DistributedGradients::set_loss_scale)
      .def("set_timeline", &gt::DistributedGradients::set_timeline)
      .def("plan_json",
           [](const gt::DistributedGradients& g) { return g.plan().to_json().dump(); })
      .def("last_step",
           [](const gt::DistributedGradients& g) { return step_stats(g.last_step()); })
      .def_property_readonly("steps", &gt::DistributedGradients::steps)
      .def_property_readonly("rank",
                             [](const gt::DistributedGradients& g) { return g.transport().rank(); })
      .def_property_readonly("world_size",
                             [](const gt::DistributedGradients& g) { return g.transport().size(); })
      .def(
          "save_state",
          [](const gt::DistributedGradients& g, bool undo) {
            return to_bytes(g.save_state(undo ? Engine::StateFor::kUndo
                                              : Engine::StateFor::kCheckpoint));
          },
          py::arg("undo") = false)
      .def("save_all_states",
           [](const gt::DistributedGradients& g) {
             return all_states([&] { return g.save_all_states(); });
           })
      .def("load_state", [](gt::DistributedGradients& g, const std::string& state) {
        g.load_state(as_span(state));
      });

  py::class_<PyEngine>(m, "Engine")
      .def(py::init([](std::shared_ptr<Transport> transport, const std::string& plan_json,
                       uint64_t seed, const std::string& timeline, int local_size,
                       int codec_threads) {
             py::gil_scoped_release release;
             return std::make_unique<PyEngine>(std::move(transport), plan_json, seed, timeline,
                                               local_size, codec_threads);
           }),
           py::arg("transport"), py::arg("plan_json"), py::arg("seed") = 0,
           py::arg("timeline") = "", py::arg("local_size") = 0, py::arg("codec_threads") = 1)
      .def("ready", &PyEngine::ready)
      .def("synchronize", &PyEngine::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("last_step", [](PyEngine& e) { return step_stats(e.engine().last_step()); })
      .def_property_readonly("steps", [](PyEngine& e) { return e.engine().step(); })
      .def(
          "save_state",
          [](PyEngine& e, bool undo) {
            return to_bytes(e.engine().save_state(undo ? Engine::StateFor::kUndo
                                                       : Engine::StateFor::kCheckpoint));
          },
          py::arg("undo") = false)
      .def("save_all_states",
           [](PyEngine& e) { return all_states([&] { return e.engine().save_all_states(); }); })
      .def("load_state",
           [](PyEngine& e, const std::string& s) { e.engine().load_state(as_span(s)); })
      .def("set_plan",
           [](PyEngine& e, const std::string& plan_json, bool trial) {
             Plan plan = Plan::parse(plan_json);
             py::gil_scoped_release release;
             e.engine().set_plan(std::move(plan), trial);
           },
           py::arg("plan_json"), py::arg("trial") = false)
      .def("set_timeline", [](PyEngine& e, const std::string& p) { e.engine().set_timeline(p); })
      .def("set_loss_scale", [](PyEngine& e, double scale) { e.engine().set_loss_scale(scale); });
}
