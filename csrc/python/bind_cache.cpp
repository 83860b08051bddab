// Bindings of the paged block allocator and the slot-mapping kernel.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "tensor_view.h"
#include "verispec/block_allocator.h"
#include "verispec/slot_mapping.h"

namespace py = pybind11;

namespace verispec {
namespace {

void check_batch_arg(const char* op, const char* name, const std::vector<int64_t>& v,
                     size_t batch) {
  if (v.size() != batch) {
    throw py::value_error(std::string(op) + ": " + name + " must have len(seqs) = " +
                          std::to_string(batch) + " entries, got " +
                          std::to_string(v.size()));
  }
}

void append_batch(BlockAllocator& a, const std::vector<int64_t>& seqs,
                  const std::vector<int64_t>& counts, const py::handle& slot_mapping) {
  constexpr const char* op = "append_batch";
  check_batch_arg(op, "counts", counts, seqs.size());
  auto out = TensorView::from(slot_mapping, op, "slot_mapping", /*writable=*/true);
  out.expect({DType::kInt32}, {{"T", kAnyDim}}).expect_cpu().expect_contiguous();
  a.append_batch(seqs.data(), counts.data(), static_cast<int64_t>(seqs.size()),
                 out.data<int32_t>(), out.numel());
}

void fill_block_tables(const BlockAllocator& a, const std::vector<int64_t>& seqs,
                       const py::handle& block_tables) {
  constexpr const char* op = "fill_block_tables";
  auto out = TensorView::from(block_tables, op, "block_tables", true);
  out.expect({DType::kInt32}, {{"B", static_cast<int64_t>(seqs.size())}, {"max_blocks", kAnyDim}})
      .expect_cpu()
      .expect_last_dim_contiguous();
  a.fill_block_tables(seqs.data(), static_cast<int64_t>(seqs.size()), out.data<int32_t>(),
                      out.size(1), out.stride(0));
}

void fill_context_lens(const BlockAllocator& a, const std::vector<int64_t>& seqs,
                       const py::handle& context_lens) {
  constexpr const char* op = "fill_context_lens";
  auto out = TensorView::from(context_lens, op, "context_lens", true);
  out.expect({DType::kInt32}, {{"B", static_cast<int64_t>(seqs.size())}})
      .expect_cpu()
      .expect_contiguous();
  a.fill_context_lens(seqs.data(), static_cast<int64_t>(seqs.size()), out.data<int32_t>());
}

void fill_slot_mapping(const BlockAllocator& a, const std::vector<int64_t>& seqs,
                       const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                       const py::handle& slot_mapping) {
  constexpr const char* op = "fill_slot_mapping";
  check_batch_arg(op, "starts", starts, seqs.size());
  check_batch_arg(op, "counts", counts, seqs.size());
  auto out = TensorView::from(slot_mapping, op, "slot_mapping", true);
  out.expect({DType::kInt32}, {{"T", kAnyDim}}).expect_cpu().expect_contiguous();
  a.fill_slot_mapping(seqs.data(), starts.data(), counts.data(),
                      static_cast<int64_t>(seqs.size()), out.data<int32_t>(), out.numel());
}

void slot_mapping(const py::handle& block_tables_obj, const py::handle& row_index_obj,
                  const py::handle& positions_obj, int64_t block_size,
                  const py::handle& out_obj, intptr_t stream) {
  constexpr const char* op = "slot_mapping";
  if (block_size <= 0) {
    throw py::value_error(std::string(op) + ": block_size must be > 0, got " +
                          std::to_string(block_size));
  }
  auto tables = TensorView::from(block_tables_obj, op, "block_tables");
  tables.expect({DType::kInt32}, {{"B", kAnyDim}, {"max_blocks", kAnyDim}})
      .expect_last_dim_contiguous();
  auto rows = TensorView::from(row_index_obj, op, "row_index");
  rows.expect({DType::kInt32}, {{"T", kAnyDim}}).expect_contiguous();
  const int64_t T = rows.size(0);
  auto pos = TensorView::from(positions_obj, op, "positions");
  pos.expect({DType::kInt32}, {{"T", T}}).expect_contiguous();
  auto out = TensorView::from(out_obj, op, "out", true);
  out.expect({DType::kInt32}, {{"T", T}}).expect_contiguous();
  expect_same_device({&tables, &rows, &pos, &out});
  if (tables.device_kind() == DeviceKind::kCPU) {
    int64_t bad;
    {
      py::gil_scoped_release release;
      bad = slot_mapping_cpu(tables.data<int32_t>(), tables.size(0), tables.size(1),
                             tables.stride(0), rows.data<int32_t>(), pos.data<int32_t>(),
                             T, block_size, out.data<int32_t>());
    }
    if (bad >= 0) {
      throw py::value_error(
          std::string(op) + ": token " + std::to_string(bad) + " (row " +
          std::to_string(rows.data<int32_t>()[bad]) + ", position " +
          std::to_string(pos.data<int32_t>()[bad]) +
          ") is outside the block table or maps to a padding entry");
    }
    return;
  }
#ifdef VERISPEC_WITH_CUDA
  int err;
  {
    py::gil_scoped_release release;
    err = slot_mapping_cuda(tables.data<int32_t>(), tables.size(0), tables.size(1),
                            tables.stride(0), rows.data<int32_t>(), pos.data<int32_t>(), T,
                            block_size, out.data<int32_t>(), stream);
  }
  if (err != 0) {
    throw std::runtime_error(std::string(op) + ": CUDA launch failed with error " +
                             std::to_string(err));
  }
#else
  (void)stream;
  throw std::runtime_error(std::string(op) +
                           ": got CUDA tensors, but this build of verispec has no CUDA "
                           "kernels (rebuild with nvcc on PATH)");
#endif
}

}  // namespace

void register_cache(py::module_& m) {
  py::class_<BlockAllocator>(m, "BlockAllocator", R"doc(
Paged KV-cache block allocator: a pool of num_blocks blocks of block_size token slots.

Owns the free list, a refcount per block, and per sequence its block table and
length. Slot ids are block * block_size + offset; negative slot ids mean padding.
Every operation either succeeds or raises leaving all state unchanged.
)doc")
      .def(py::init<int64_t, int64_t>(), py::arg("num_blocks"), py::arg("block_size"))
      .def_property_readonly("num_blocks", &BlockAllocator::num_blocks)
      .def_property_readonly("block_size", &BlockAllocator::block_size)
      .def_property_readonly("num_free_blocks", &BlockAllocator::num_free_blocks)
      .def_property_readonly("num_sequences", &BlockAllocator::num_sequences)
      .def("add_sequence", &BlockAllocator::add_sequence,
           "Adds an empty sequence and returns its id (ids are never reused).")
      .def(
          "append",
          [](BlockAllocator& a, int64_t seq, int64_t n) {
            std::vector<int32_t> slots;
            a.append(seq, n, &slots);
            return slots;
          },
          py::arg("seq"), py::arg("n"),
          "Reserves n more token slots and returns their slot ids. If the sequence's "
          "partly filled last block is shared (after fork), it is first copied to a "
          "fresh block; the copy is queued for take_block_copies(). Raises "
          "CacheFullError (nothing changed) when the pool is too small.")
      .def("rollback", &BlockAllocator::rollback, py::arg("seq"), py::arg("new_len"),
           "Lowers the length to new_len and releases whole trailing blocks; cost "
           "independent of the sequence length.")
      .def("fork", &BlockAllocator::fork, py::arg("seq"),
           "New sequence sharing all blocks of seq by refcount. The shared, partly "
           "filled last block is copied on the first append into it by either "
           "sequence (copy-on-write), reported by take_block_copies().")
      .def("free", &BlockAllocator::free, py::arg("seq"),
           "Releases the sequence; raises KeyError for an unknown or freed id.")
      .def("length", &BlockAllocator::length, py::arg("seq"))
      .def("block_table", &BlockAllocator::block_table, py::arg("seq"))
      .def("refcount", &BlockAllocator::refcount, py::arg("block"))
      .def("sequence_ids", &BlockAllocator::sequence_ids)
      .def("blocks_needed", &BlockAllocator::blocks_needed, py::arg("seq"), py::arg("n"),
           "Free blocks that append(seq, n) would take (including a copy-on-write).")
      .def(
          "take_block_copies",
          [](BlockAllocator& a) {
            py::list out;
            for (const BlockCopy& c : a.take_block_copies()) {
              out.append(py::make_tuple(c.src, c.dst, c.num_tokens));
            }
            return out;
          },
          "Returns and clears the queued copy-on-write copies as (src_block, "
          "dst_block, num_tokens): copy the first num_tokens slots of src into dst in "
          "every KV pool before writing the slots returned by append.")
      .def_property_readonly("num_pending_block_copies",
                             &BlockAllocator::num_pending_block_copies)
      .def("append_batch", &append_batch, py::arg("seqs"), py::arg("counts"),
           py::arg("slot_mapping"),
           "Appends counts[i] slots to seqs[i] for all i atomically, writing the new "
           "slot ids in order into slot_mapping (int32 [T], T >= sum(counts); the tail "
           "is set to -1).")
      .def("fill_block_tables", &fill_block_tables, py::arg("seqs"), py::arg("block_tables"),
           "Writes the block tables of seqs into block_tables (int32 [B, max_blocks]); "
           "unused entries are -1.")
      .def("fill_context_lens", &fill_context_lens, py::arg("seqs"), py::arg("context_lens"),
           "Writes the lengths of seqs into context_lens (int32 [B]).")
      .def("fill_slot_mapping", &fill_slot_mapping, py::arg("seqs"), py::arg("starts"),
           py::arg("counts"), py::arg("slot_mapping"),
           "Writes the slot ids of positions [starts[i], starts[i] + counts[i]) of each "
           "sequence, concatenated, into slot_mapping (int32 [T]); the tail is -1.")
      .def("__repr__", [](const BlockAllocator& a) {
        return "BlockAllocator(num_blocks=" + std::to_string(a.num_blocks()) +
               ", block_size=" + std::to_string(a.block_size()) +
               ", free=" + std::to_string(a.num_free_blocks()) +
               ", sequences=" + std::to_string(a.num_sequences()) + ")";
      });

  m.def("slot_mapping", &slot_mapping, py::arg("block_tables"), py::arg("row_index"),
        py::arg("positions"), py::arg("block_size"), py::arg("out"), py::arg("stream") = 0,
        "out[t] = block_tables[row_index[t], positions[t] // block_size] * block_size + "
        "positions[t] % block_size, or -1 for padding tokens (negative row or "
        "position). CPU or CUDA tensors (all on one device); stream is a CUDA stream "
        "handle as an integer.");
}

}  // namespace verispec
