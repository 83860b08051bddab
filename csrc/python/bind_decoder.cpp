// Bindings of the native SpecDecoder. The StepRunner is subclassed in Python
// (python/verispec/decoder.py): it runs the models and the sampling ops on tensors,
// while the loop, the bookkeeping and the stop rules stay native.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "verispec/spec_decoder.h"

namespace py = pybind11;

namespace verispec {
namespace {

class PyStepRunner : public StepRunner {
 public:
  using StepRunner::StepRunner;
  void copy_blocks(ModelRole role, const std::vector<BlockCopy>& copies) override {
    if (copies.empty()) return;
    std::vector<std::tuple<int32_t, int32_t, int32_t>> list;
    for (const auto& c : copies) list.emplace_back(c.src, c.dst, c.num_tokens);
    py::gil_scoped_acquire gil;
    py::function f = py::get_override(static_cast<const StepRunner*>(this), "copy_blocks");
    if (!f) throw std::runtime_error("StepRunner.copy_blocks is not implemented");
    f(role, list);
  }
  void forward(const ForwardBatch& batch) override {
    PYBIND11_OVERRIDE_PURE(void, StepRunner, forward, std::cref(batch));
  }
  std::vector<int32_t> sample_draft(int64_t batch, int64_t num_spec, int64_t position,
                                    const std::vector<int32_t>& rows, const RowPolicy& policy,
                                    uint64_t seed, uint64_t offset) override {
    PYBIND11_OVERRIDE_PURE(std::vector<int32_t>, StepRunner, sample_draft, batch, num_spec,
                           position, rows, std::cref(policy), seed, offset);
  }
  VerifyResult verify(const VerifyRequest& request) override {
    PYBIND11_OVERRIDE_PURE(VerifyResult, StepRunner, verify, std::cref(request));
  }
};

// A writable memoryview over a vector owned by the batch (valid during the call).
template <typename T>
py::memoryview view_of(const std::vector<T>& v) {
  return py::memoryview::from_buffer(const_cast<T*>(v.data()), {static_cast<py::ssize_t>(v.size())},
                                     {static_cast<py::ssize_t>(sizeof(T))}, /*readonly=*/false);
}

py::dict stats_dict(const SequenceStats& s) {
  py::dict d;
  d["steps"] = s.steps;
  d["draft_forwards"] = s.draft_forwards;
  d["proposed"] = s.proposed;
  d["accepted"] = s.accepted;
  d["emitted"] = s.emitted;
  d["acceptance_rate"] = s.proposed > 0
                              ? py::object(py::float_(double(s.accepted) / double(s.proposed)))
                              : py::object(py::none());
  d["tokens_per_target_pass"] = s.steps > 0 ? double(s.emitted) / double(s.steps) : 0.0;
  py::list by_pos;
  for (size_t j = 0; j < s.proposed_at.size(); ++j) {
    by_pos.append(s.proposed_at[j] > 0 ? double(s.accepted_at[j]) / double(s.proposed_at[j]) : 0.0);
  }
  d["acceptance_by_position"] = by_pos;
  d["proposed_by_position"] = s.proposed_at;
  d["accepted_by_position"] = s.accepted_at;
  d["k_history"] = s.k_history;
  d["acceptance_estimate"] = s.acceptance_estimate;
  return d;
}

}  // namespace

void register_decoder(py::module_& m) {
  py::enum_<ModelRole>(m, "ModelRole")
      .value("target", ModelRole::kTarget)
      .value("draft", ModelRole::kDraft);

  py::class_<ForwardBatch>(m, "ForwardBatch")
      .def_readonly("role", &ForwardBatch::role)
      .def_readonly("num_rows", &ForwardBatch::num_rows)
      .def_readonly("max_blocks", &ForwardBatch::max_blocks)
      .def_property_readonly("input_ids", [](const ForwardBatch& b) { return view_of(b.input_ids); })
      .def_property_readonly("positions", [](const ForwardBatch& b) { return view_of(b.positions); })
      .def_property_readonly("slot_mapping", [](const ForwardBatch& b) { return view_of(b.slot_mapping); })
      .def_property_readonly("block_tables", [](const ForwardBatch& b) { return view_of(b.block_tables); })
      .def_property_readonly("context_lens", [](const ForwardBatch& b) { return view_of(b.context_lens); })
      .def_property_readonly("query_start", [](const ForwardBatch& b) { return view_of(b.query_start); })
      .def_property_readonly("logits_indices", [](const ForwardBatch& b) { return view_of(b.logits_indices); });

  py::class_<RowPolicy>(m, "RowPolicy")
      .def_readonly("temperature", &RowPolicy::temperature)
      .def_readonly("top_k", &RowPolicy::top_k)
      .def_readonly("top_p", &RowPolicy::top_p)
      .def_readonly("min_p", &RowPolicy::min_p);

  py::class_<VerifyRequest>(m, "VerifyRequest")
      .def_readonly("batch", &VerifyRequest::batch)
      .def_readonly("num_spec", &VerifyRequest::num_spec)
      .def_readonly("draft_tokens", &VerifyRequest::draft_tokens)
      .def_readonly("num_draft", &VerifyRequest::num_draft)
      .def_readonly("use_draft_probs", &VerifyRequest::use_draft_probs)
      .def_readonly("policy", &VerifyRequest::policy)
      .def_readonly("seed", &VerifyRequest::seed)
      .def_readonly("offset", &VerifyRequest::offset);

  py::class_<VerifyResult>(m, "VerifyResult")
      .def(py::init([](std::vector<int32_t> tokens, std::vector<int32_t> num_emitted,
                       std::vector<int32_t> num_accepted) {
             return VerifyResult{std::move(tokens), std::move(num_emitted), std::move(num_accepted)};
           }),
           py::arg("tokens"), py::arg("num_emitted"), py::arg("num_accepted"));

  py::class_<StepRunner, PyStepRunner>(m, "StepRunner")
      .def(py::init<>())
      .def("forward", &StepRunner::forward)
      .def("sample_draft", &StepRunner::sample_draft)
      .def("verify", &StepRunner::verify);

  py::class_<SpecDecoder>(m, "SpecDecoderCore")
      .def(py::init([](int64_t num_spec, bool has_draft_model, int64_t target_num_blocks,
                       int64_t draft_num_blocks, int64_t block_size, int64_t max_context,
                       uint64_t seed, int64_t ngram_min_n, int64_t ngram_max_n,
                       bool adaptive_k, bool draft_shares_target_cache) {
             DecoderConfig c;
             c.num_spec = num_spec;
             c.has_draft_model = has_draft_model;
             c.target_num_blocks = target_num_blocks;
             c.draft_num_blocks = draft_num_blocks;
             c.block_size = block_size;
             c.max_context = max_context;
             c.seed = seed;
             c.ngram_min_n = ngram_min_n;
             c.ngram_max_n = ngram_max_n;
             c.adaptive_k = adaptive_k;
             c.draft_shares_target_cache = draft_shares_target_cache;
             return std::make_unique<SpecDecoder>(c);
           }),
           py::arg("num_spec"), py::arg("has_draft_model"), py::arg("target_num_blocks"),
           py::arg("draft_num_blocks"), py::arg("block_size"), py::arg("max_context"),
           py::arg("seed"), py::arg("ngram_min_n") = 0, py::arg("ngram_max_n") = 0,
           py::arg("adaptive_k") = false, py::arg("draft_shares_target_cache") = false)
      .def(
          "add",
          [](SpecDecoder& d, const std::vector<int32_t>& prompt, int64_t vocab_size,
             int64_t max_new_tokens, bool greedy, float temperature, int32_t top_k, float top_p,
             float min_p, std::vector<int32_t> eos_ids,
             std::vector<std::vector<int32_t>> stop_sequences) {
            SamplingParams sp{greedy, temperature, top_k, top_p, min_p};
            StopParams st{max_new_tokens, std::move(eos_ids), std::move(stop_sequences)};
            return d.add(prompt, sp, st, vocab_size);
          },
          py::arg("prompt"), py::arg("vocab_size"), py::arg("max_new_tokens"), py::arg("greedy"),
          py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
          py::arg("eos_ids"), py::arg("stop_sequences"))
      .def("abort", &SpecDecoder::abort, py::arg("seq"))
      .def("release", &SpecDecoder::release, py::arg("seq"))
      .def(
          "step",
          [](SpecDecoder& d, StepRunner& runner) {
            py::list out;
            for (const StepOutput& o : d.step(runner)) {
              out.append(py::make_tuple(o.seq, o.new_tokens, finish_reason_name(o.finish)));
            }
            return out;
          },
          py::arg("runner"))
      .def("reseed", &SpecDecoder::reseed, py::arg("seed"))
      .def("has_running", &SpecDecoder::has_running)
      .def("running", &SpecDecoder::running)
      .def("generated", &SpecDecoder::generated, py::arg("seq"))
      .def("finish_reason",
           [](const SpecDecoder& d, int64_t seq) { return finish_reason_name(d.finish_reason(seq)); },
           py::arg("seq"))
      .def("stats", [](const SpecDecoder& d, int64_t seq) { return stats_dict(d.stats(seq)); },
           py::arg("seq"))
      .def("cache_len", &SpecDecoder::cache_len, py::arg("seq"), py::arg("role"))
      .def("committed_len", &SpecDecoder::committed_len, py::arg("seq"))
      .def("committed", &SpecDecoder::committed, py::arg("seq"))
      .def("block_table", &SpecDecoder::block_table, py::arg("seq"), py::arg("role"))
      .def("num_free_blocks",
           [](const SpecDecoder& d, ModelRole role) { return d.allocator(role).num_free_blocks(); },
           py::arg("role"))
      .def("num_blocks",
           [](const SpecDecoder& d, ModelRole role) { return d.allocator(role).num_blocks(); },
           py::arg("role"))
      .def_property_readonly("offset", &SpecDecoder::offset)
      .def("times", [](const SpecDecoder& d) {
        const PhaseTimes& t = d.times();
        py::dict out;
        out["draft_forward_s"] = t.draft_forward;
        out["draft_sample_s"] = t.draft_sample;
        out["target_forward_s"] = t.target_forward;
        out["verify_s"] = t.verify;
        out["bookkeeping_s"] = t.bookkeeping;
        out["steps"] = t.steps;
        return out;
      }, "Wall time by phase, summed over all steps so far.")
      .def("cost_model", [](const SpecDecoder& d) {
        py::dict out;
        out["draft_pass_s"] = d.cost_model().has_draft() ? py::object(py::float_(d.cost_model().draft_pass()))
                                                          : py::object(py::none());
        out["target_pass_s"] = d.cost_model().target_passes();
        return out;
      }, "The adaptive-k cost model as measured: draft pass and target pass by tokens per row.");

  py::class_<NGramIndex>(m, "NGramIndex", "The n-gram prompt-lookup index of one sequence.")
      .def(py::init<int64_t, int64_t>(), py::arg("min_n"), py::arg("max_n"))
      .def_property_readonly("length", &NGramIndex::length)
      .def_property_readonly("tokens", &NGramIndex::tokens)
      .def("extend", [](NGramIndex& g, const std::vector<int32_t>& t) {
        g.extend(t.data(), static_cast<int64_t>(t.size()));
      }, py::arg("tokens"))
      .def("rollback", &NGramIndex::rollback, py::arg("new_len"))
      .def("propose", [](const NGramIndex& g, int64_t k) { return g.propose(k); }, py::arg("k"))
      .def("propose_matched", [](const NGramIndex& g, int64_t k) {
        int64_t n = 0;
        auto tokens = g.propose(k, &n);
        return py::make_tuple(tokens, n);
      }, py::arg("k"), "(proposal, length of the matched suffix; 0: no match)");

  m.def("expected_tokens", &expected_tokens, py::arg("a"), py::arg("k"),
        "(1 - a^(k+1)) / (1 - a): mean tokens per verify step at acceptance rate a.");
  m.def("best_k", &best_k, py::arg("a"), py::arg("draft_pass"), py::arg("target_pass"),
        py::arg("max_k"),
        "The k that maximises expected tokens per unit time (the adaptive-k rule).");
  py::class_<CostModel>(m, "CostModel", "Adaptive k's online pass costs (for tests and tools).")
      .def(py::init<int64_t>(), py::arg("max_tokens_per_row"))
      .def("observe_draft", &CostModel::observe_draft, py::arg("seconds_per_pass"))
      .def("observe_target", &CostModel::observe_target, py::arg("tokens_per_row"),
           py::arg("seconds"))
      .def_property_readonly("draft_pass", &CostModel::draft_pass)
      .def("target_passes", &CostModel::target_passes);
  m.def("probe_interval", &probe_interval, py::arg("draft_pass"), py::arg("target_pass"),
        "Plain steps between probes at k = 1 while adaptive k keeps speculation off.");
  m.attr("PROBE_BUDGET") = kProbeBudget;

  m.def(
      "apply_stop_rules",
      [](int64_t max_new_tokens, std::vector<int32_t> eos_ids,
         std::vector<std::vector<int32_t>> stop_sequences, const std::vector<int32_t>& generated,
         const std::vector<int32_t>& tokens, int64_t prompt_len, int64_t max_context) {
        StopParams st{max_new_tokens, std::move(eos_ids), std::move(stop_sequences)};
        FinishReason reason;
        int64_t keep = apply_stop_rules(st, generated, tokens.data(),
                                        static_cast<int64_t>(tokens.size()), prompt_len,
                                        max_context, &reason);
        return py::make_tuple(keep, finish_reason_name(reason));
      },
      py::arg("max_new_tokens"), py::arg("eos_ids"), py::arg("stop_sequences"),
      py::arg("generated"), py::arg("tokens"), py::arg("prompt_len"), py::arg("max_context"),
      "The decoder's stop rules, exposed for tests: (kept count, finish reason).");
}

}  // namespace verispec
