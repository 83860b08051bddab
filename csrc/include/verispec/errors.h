// Error types of the native core. The core throws these; the Python binding maps
// each to one Python exception class (see csrc/python/module.cpp). Kernels never
// throw: they return an OpStatus (ops.h) that the binding turns into one of these.
#pragma once

#include <stdexcept>
#include <string>

namespace verispec {

// The pool has too few free blocks for the request; nothing was changed.
class CacheFullError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A sequence id that the allocator does not know (never added, or freed).
class UnknownSequenceError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// A value outside its domain (negative size, rollback past the length, ...).
class InvalidArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// SpecDecoder: begin_step() or reseed() while a step is open, or commit() with a step
// id that is not the open step's.
class StepInProgressError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace verispec
