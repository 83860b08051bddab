// Bindings of the native SpecDecoder. Every call goes down: python/verispec/decoder.py
// drives a step through begin_step / commit / cancel_step and runs the models and the
// sampling ops itself; the decisions stay native (csrc/include/verispec/spec_decoder.h).
// The methods hold the GIL for their whole (short, never blocking) duration; the
// decoder's own mutex serialises C++ callers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "verispec/spec_decoder.h"

namespace py = pybind11;

namespace verispec {
namespace {

// A host int32 array handed back by the caller (a numpy view of the step's results).
struct Int32Array {
  const int32_t* data = nullptr;
  int64_t size = 0;
  py::buffer_info info;  // keeps the view alive
};

Int32Array int32_array(const py::object& obj, const char* name) {
  Int32Array a;
  if (obj.is_none()) return a;
  if (!py::isinstance<py::buffer>(obj)) {
    throw InvalidArgumentError(std::string("commit: ") + name +
                               " must be an int32 buffer (a numpy array), got " +
                               std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  a.info = py::reinterpret_borrow<py::buffer>(obj).request();
  if (a.info.itemsize != 4 || (a.info.format != "i" && a.info.format != "=i" && a.info.format != "<i" &&
                               a.info.format != "l")) {
    throw InvalidArgumentError(std::string("commit: ") + name + " must hold int32 values, got format '" +
                               a.info.format + "' of " + std::to_string(a.info.itemsize) + " bytes");
  }
  int64_t expect_stride = a.info.itemsize;
  for (int64_t d = a.info.ndim - 1; d >= 0; --d) {
    if (a.info.shape[static_cast<size_t>(d)] > 1 && a.info.strides[static_cast<size_t>(d)] != expect_stride) {
      throw InvalidArgumentError(std::string("commit: ") + name + " must be C-contiguous");
    }
    expect_stride *= a.info.shape[static_cast<size_t>(d)];
  }
  a.data = static_cast<const int32_t*>(a.info.ptr);
  a.size = a.info.size;
  return a;
}

py::list copies_list(const std::vector<BlockCopy>& copies) {
  py::list out;
  for (const auto& c : copies) out.append(py::make_tuple(c.src, c.dst, c.num_tokens));
  return out;
}

py::dict pass_dict(const PassLayout& l) {
  py::dict d;
  d["role"] = l.role;
  d["num_rows"] = l.num_rows;
  d["num_tokens"] = l.num_tokens;
  d["max_blocks"] = l.max_blocks;
  d["num_logits"] = l.num_logits;
  d["input_ids"] = l.input_ids;
  d["positions"] = l.positions;
  d["query_start"] = l.query_start;
  d["logits_indices"] = l.logits_indices;
  d["rows"] = l.rows;
  d["draft_index"] = l.draft_index;
  d["prev_index"] = l.prev_index;
  d["num_children"] = l.num_children;
  d["q_index"] = l.q_index;
  d["fill_positions"] = l.fill_positions;
  d["fill_sources"] = l.fill_sources;
  d["num_fill"] = l.num_fill;
  d["slot_mapping"] = l.slot_mapping;
  d["block_tables"] = l.block_tables;
  d["context_lens"] = l.context_lens;
  d["has_tree_mask"] = l.has_tree_mask;
  d["tree_mask"] = l.tree_mask;
  return d;
}

// The plan as plain Python values, built in one call (no property reads per field).
py::object plan_dict(const StepPlan& p) {
  if (p.passes.empty()) return py::none();
  py::dict d;
  d["step_id"] = p.step_id;
  d["batch"] = p.batch;
  d["k"] = p.k;
  d["seqs"] = p.seqs;
  d["row_k"] = p.row_k;
  d["prefill_seqs"] = p.prefill_seqs;
  d["draft_model"] = p.draft_model;
  d["seed"] = p.seed;
  d["offset"] = p.offset;
  py::list passes;
  for (const auto& l : p.passes) passes.append(pass_dict(l));
  d["passes"] = passes;
  d["draft_tokens"] = p.draft_tokens;
  d["num_draft"] = p.num_draft;
  d["tree"] = p.tree;
  d["tree_parents"] = p.tree_parents;
  d["draft_tree"] = p.draft_tree;
  py::dict pol;
  pol["uniform"] = p.policy.uniform;
  pol["temperature"] = p.policy.temperature;
  pol["top_k"] = p.policy.top_k;
  pol["top_p"] = p.policy.top_p;
  pol["min_p"] = p.policy.min_p;
  pol["temperature_rows"] = p.policy.temperature_rows;
  pol["top_k_rows"] = p.policy.top_k_rows;
  pol["top_p_rows"] = p.policy.top_p_rows;
  pol["min_p_rows"] = p.policy.min_p_rows;
  pol["any_keyed"] = p.policy.any_keyed;
  pol["all_keyed"] = p.policy.all_keyed;
  pol["keyed_rows"] = p.policy.keyed_rows;
  pol["seed_rows"] = p.policy.seed_rows;
  pol["position_rows"] = p.policy.position_rows;
  d["policy"] = pol;
  d["inputs"] = py::bytearray(reinterpret_cast<const char*>(p.inputs.data()), p.inputs.size());
  d["target_copies"] = copies_list(p.target_copies);
  d["draft_copies"] = copies_list(p.draft_copies);
  return d;
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
  d["preemptions"] = s.preemptions;
  d["prefill_chunks"] = s.prefill_chunks;
  return d;
}

}  // namespace

void register_decoder(py::module_& m) {
  py::enum_<ModelRole>(m, "ModelRole")
      .value("target", ModelRole::kTarget)
      .value("draft", ModelRole::kDraft);

  py::class_<SpecDecoder>(m, "SpecDecoder",
                          "The native decoder: sequences, and the decisions of each step.")
      .def(py::init([](int64_t k, bool has_draft_model, int64_t target_num_blocks,
                       int64_t draft_num_blocks, int64_t block_size, int64_t vocab_size,
                       int64_t max_context, uint64_t seed, int64_t ngram_min_n,
                       int64_t ngram_max_n, bool adaptive_k, bool draft_shares_target_cache,
                       int64_t draft_max_context, int64_t max_num_seqs,
                       int64_t max_tokens_per_step, int64_t ngram_branches,
                       int64_t draft_branches, bool draft_reads_target) {
             DecoderConfig c;
             c.k = k;
             c.has_draft_model = has_draft_model;
             c.target_num_blocks = target_num_blocks;
             c.draft_num_blocks = draft_num_blocks;
             c.block_size = block_size;
             c.vocab_size = vocab_size;
             c.max_context = max_context;
             c.seed = seed;
             c.ngram_min_n = ngram_min_n;
             c.ngram_max_n = ngram_max_n;
             c.adaptive_k = adaptive_k;
             c.draft_shares_target_cache = draft_shares_target_cache;
             c.draft_max_context = draft_max_context;
             c.max_num_seqs = max_num_seqs;
             c.max_tokens_per_step = max_tokens_per_step;
             c.ngram_branches = ngram_branches;
             c.draft_branches = draft_branches;
             c.draft_reads_target = draft_reads_target;
             return std::make_unique<SpecDecoder>(c);
           }),
           py::arg("k"), py::arg("has_draft_model"), py::arg("target_num_blocks"),
           py::arg("draft_num_blocks"), py::arg("block_size"), py::arg("vocab_size"),
           py::arg("max_context"), py::arg("seed"), py::arg("ngram_min_n") = 0,
           py::arg("ngram_max_n") = 0, py::arg("adaptive_k") = false,
           py::arg("draft_shares_target_cache") = false, py::arg("draft_max_context") = 0,
           py::arg("max_num_seqs") = 0, py::arg("max_tokens_per_step") = 0,
           py::arg("ngram_branches") = 1, py::arg("draft_branches") = 1,
           py::arg("draft_reads_target") = false)
      .def(
          "add",
          [](SpecDecoder& d, const std::vector<int32_t>& prompt, int64_t max_new_tokens,
             float temperature, int32_t top_k, float top_p, float min_p,
             std::vector<int32_t> eos_ids, std::vector<std::vector<int32_t>> stop_sequences,
             const std::optional<uint64_t>& seed, int64_t priority,
             const std::vector<int32_t>& ngram_context) {
            SamplingParams sp{temperature, top_k, top_p, min_p, seed.has_value(),
                              seed.value_or(0)};
            StopParams st{max_new_tokens, std::move(eos_ids), std::move(stop_sequences)};
            return d.add(prompt, sp, st, priority, ngram_context);
          },
          py::arg("prompt"), py::arg("max_new_tokens"), py::arg("temperature"), py::arg("top_k"),
          py::arg("top_p"), py::arg("min_p"), py::arg("eos_ids"), py::arg("stop_sequences"),
          py::arg("seed") = py::none(), py::arg("priority") = 0,
          py::arg("ngram_context") = std::vector<int32_t>{})
      .def("abort", &SpecDecoder::abort, py::arg("seq"))
      .def("release", &SpecDecoder::release, py::arg("seq"))
      .def("begin_step", [](SpecDecoder& d) { return plan_dict(d.begin_step()); },
           "Opens a step: a dict (rows, k, passes, packed inputs), or None if nothing runs.")
      .def(
          "commit",
          [](SpecDecoder& d, uint64_t step_id, const py::object& tokens,
             const py::object& num_emitted, const py::object& num_accepted,
             const py::object& draft_tokens, std::vector<double> draft_forward,
             std::vector<double> draft_sample, double target_forward, double verify,
             double total, const py::object& accepted_nodes) {
            const Int32Array t = int32_array(tokens, "tokens");
            const Int32Array n = int32_array(accepted_nodes, "accepted_nodes");
            const Int32Array e = int32_array(num_emitted, "num_emitted");
            const Int32Array a = int32_array(num_accepted, "num_accepted");
            const Int32Array q = int32_array(draft_tokens, "draft_tokens");
            VerifyOutputs out{t.data, t.size, e.data, e.size, a.data, a.size, q.data, q.size,
                              n.data, n.size};
            StepTimes times{std::move(draft_forward), std::move(draft_sample), target_forward,
                            verify, total};
            py::list result;
            for (const CommitOutput& o : d.commit(step_id, out, times)) {
              result.append(py::make_tuple(o.seq, o.new_tokens, finish_reason_name(o.finish)));
            }
            return result;
          },
          py::arg("step_id"), py::arg("tokens"), py::arg("num_emitted"), py::arg("num_accepted"),
          py::arg("draft_tokens"), py::arg("draft_forward"), py::arg("draft_sample"),
          py::arg("target_forward"), py::arg("verify"), py::arg("total"),
          py::arg("accepted_nodes") = py::none(),
          "Checks the step's outputs and commits them: [(seq, new tokens, finish reason)].")
      .def("cancel_step", &SpecDecoder::cancel_step, py::arg("step_id"))
      .def_property_readonly("step_open", &SpecDecoder::step_open)
      .def("reseed", &SpecDecoder::reseed, py::arg("seed"))
      .def("has_running", &SpecDecoder::has_running)
      .def("num_running", &SpecDecoder::num_running)
      .def("num_waiting", &SpecDecoder::num_waiting)
      .def("num_preemptions", &SpecDecoder::num_preemptions)
      .def("num_sequences", &SpecDecoder::num_sequences)
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
      .def("num_free_blocks", &SpecDecoder::num_free_blocks, py::arg("role"))
      .def("num_blocks", &SpecDecoder::num_blocks, py::arg("role"))
      .def_property_readonly("offset", &SpecDecoder::offset)
      .def("times", [](const SpecDecoder& d) {
        const PhaseTimes t = d.times();
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
        const CostModel c = d.cost_model();
        py::dict out;
        out["draft_pass_s"] = c.has_draft() ? py::object(py::float_(c.draft_pass())) : py::object(py::none());
        out["target_pass_s"] = c.target_passes(1, d.config().k + 1);
        py::dict fit;
        fit["flat_s"] = c.flat();
        fit["knee_tokens"] = c.knee();
        fit["slope_s_per_token"] = c.slope();
        out["target_fit"] = fit;
        py::list measured;
        for (const auto& [t, s] : c.measured()) measured.append(py::make_tuple(t, s));
        out["target_measured"] = measured;
        out["acceptance_prior"] = d.acceptance_prior();
        return out;
      }, "The adaptive-k cost model: the draft pass, the target pass by its total tokens "
         "(fit and measurements), the acceptance new sequences start from.");
  m.attr("MAX_K") = kMaxK;

  py::class_<NGramIndex>(m, "NGramIndex", "The n-gram prompt-lookup index of one sequence.")
      .def(py::init<int64_t, int64_t>(), py::arg("min_n"), py::arg("max_n"))
      .def_property_readonly("length", &NGramIndex::length)
      .def_property_readonly("tokens", &NGramIndex::tokens)
      .def("extend", [](NGramIndex& g, const std::vector<int32_t>& t) {
        g.extend(t.data(), static_cast<int64_t>(t.size()));
      }, py::arg("tokens"))
      .def("rollback", &NGramIndex::rollback, py::arg("new_len"))
      .def("propose", [](const NGramIndex& g, int64_t k) { return g.propose(k); }, py::arg("k"))
      .def("propose_tree", [](const NGramIndex& g, int64_t k, int64_t branches) {
        std::vector<int32_t> parents;
        std::vector<int32_t> tokens = g.propose_tree(k, branches, &parents);
        return py::make_tuple(tokens, parents);
      }, py::arg("k"), py::arg("branches"),
         "(tokens, parents) of the n-gram trie (ngram.h): at most k nodes, `branches` children each.")
      .def("tree_shares", [](const NGramIndex& g, int64_t k, int64_t branches) {
        std::vector<int32_t> parents;
        std::vector<double> freqs, chain_freqs;
        g.propose_tree(k, branches, &parents, nullptr, &freqs, &chain_freqs);
        return py::make_tuple(freqs, chain_freqs);
      }, py::arg("k"), py::arg("branches"),
         "(shares of propose_tree's nodes, shares along propose(k)'s chain) (ngram.h).");

  m.def("expected_trie_tokens", &expected_trie_tokens, py::arg("a"), py::arg("parents"),
        py::arg("weights"),
        "Expected tokens a step emits with the first m nodes of an n-gram trie, m = 1..n "
        "(adaptive_k.h).");
  m.def("trie_node_weights", [](double r, const std::vector<int32_t>& tokens,
                                const std::vector<int32_t>& parents, const std::vector<double>& freqs,
                                const std::vector<int32_t>& chain,
                                const std::vector<double>& chain_freqs) {
          std::vector<bool> recent;
          std::vector<double> w = trie_node_weights(r, tokens, parents, freqs, chain, chain_freqs, &recent);
          return py::make_tuple(w, std::vector<bool>(recent));
        }, py::arg("r"), py::arg("tokens"), py::arg("parents"), py::arg("freqs"), py::arg("chain"),
        py::arg("chain_freqs"),
        "(w(i) per node, whether it is on the most recent continuation) (adaptive_k.h).");
  m.def("expected_tokens", &expected_tokens, py::arg("a"), py::arg("k"),
        "(1 - a^(k+1)) / (1 - a): mean tokens per verify step at acceptance rate a.");
  m.def("best_k", &best_k, py::arg("a"), py::arg("draft_pass"), py::arg("target_pass"),
        py::arg("max_k"),
        "The k that maximises expected tokens per unit time (the adaptive-k rule).");
  m.def("best_k_in_batch", &best_k_in_batch, py::arg("a"), py::arg("rest_expected"),
        py::arg("rest_k"), py::arg("draft_pass"), py::arg("target_pass"), py::arg("max_k"),
        "One row's k inside a batch (the other rows fixed): the adaptive-k rule.");
  py::class_<CostModel>(m, "CostModel", "Adaptive k's online pass costs (for tests and tools).")
      .def(py::init<>())
      .def("observe_draft", &CostModel::observe_draft, py::arg("seconds_per_pass"))
      .def("observe_target", &CostModel::observe_target, py::arg("tokens"), py::arg("seconds"))
      .def_property_readonly("draft_pass", &CostModel::draft_pass)
      .def("target_pass", &CostModel::target_pass, py::arg("tokens"))
      .def("target_passes", &CostModel::target_passes, py::arg("first"), py::arg("n"))
      .def_property_readonly("fit", [](const CostModel& c) {
        return py::make_tuple(c.flat(), c.knee(), c.slope());
      }, "(flat, knee, slope): target_pass(T) = flat + slope * max(0, T - knee).")
      .def("measured", &CostModel::measured);
  m.def(
      "best_batch_k",
      [](const std::vector<double>& a, const std::vector<int64_t>& cap, double draft_pass,
         const CostModel& cost, double rest_expected, int64_t rest_k, int64_t rest_tokens) {
        if (a.size() != cap.size()) {
          throw InvalidArgumentError("best_batch_k: cap must hold one value per row (" +
                                     std::to_string(a.size()) + "), got " +
                                     std::to_string(cap.size()));
        }
        return best_batch_k(a, cap, draft_pass, cost, BatchRest{rest_expected, rest_k, rest_tokens});
      },
      py::arg("a"), py::arg("cap"), py::arg("draft_pass"), py::arg("cost"),
      py::arg("rest_expected") = 0.0, py::arg("rest_k") = 0, py::arg("rest_tokens") = 0,
      "k per row maximising the batch's tokens per second (adaptive_k.h).");
  m.def("probe_interval", &probe_interval, py::arg("draft_pass"), py::arg("target_pass"),
        py::arg("rows") = 1,
        "Plain steps between a row's probes at k = 1 while adaptive k keeps speculation off, "
        "in a batch of `rows` rows that may all probe.");
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
