// The table of generated op stubs (defined by the generated ops_table.cc).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace tka {

struct OpDef {
  const char* module;  // public submodule: "moe", "quant", ...
  PyMethodDef* def;
};

extern const OpDef kOps[];  // terminated by {nullptr, nullptr}

}  // namespace tka
