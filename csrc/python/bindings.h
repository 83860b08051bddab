// One registration function per binding file; module.cpp calls each once.
#pragma once

#include <pybind11/pybind11.h>

namespace verispec {

void register_errors(pybind11::module_& m);
void register_cache(pybind11::module_& m);
void register_decoder(pybind11::module_& m);
void register_ops(pybind11::module_& m);
void register_layers(pybind11::module_& m);

}  // namespace verispec
