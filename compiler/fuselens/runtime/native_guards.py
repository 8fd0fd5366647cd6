"""A cache entry's tensor guards checked in C++: one call for all of them.

A model's guard function checks every parameter and buffer on every call (type, dtype, device,
shape, contiguity or strides, requires_grad): ~0.26 us a tensor in Python, so a 16-layer decoder's
151 tensors were 47 of its 102 us a call on the dev CPU, and the check that an input written in
place shares no storage with another (`guards.unshared`, 175 ns a tensor) 27 more. Decoding with
reduce-overhead calls the step once a token, and where the step's inputs are copied from pageable
memory the host's time between steps is the GPU's idle time.

Here both are one C++ call each (`TensorMatch`, `storages_distinct`), through a CPython extension
built against the running torch's c10 headers (TensorImpl's accessors: ~1 s with g++ 12, once per
machine, torch and Python, kept in `<cache dir>/guards/`, built in the background from the first
entry that wants it; until it is built, or where it cannot be, guards run in Python as before).

An entry's fast guard is made at its first call whose Python guards hold (`install`): the same
guard function with each static tensor guard left out and, at its end, the tensors those guards
read matched against that call's tensors. A tensor matches when its Python type, dtype, device,
sizes, strides (where that call's tensor was not contiguous; else contiguity), layout and
requires_grad are that tensor's, which is exactly what the left-out guards compared with their
constants (that tensor met them): the fast guard holds if and only if the Python one does. Where
the C++ cannot tell (an exception from a tensor's accessors), it answers None and the Python
guard decides.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import threading

import torch
import torch.nn as nn

from .. import settings

log = logging.getLogger("fuselens.runtime")

# fewer static tensor guards than this: the fast guard saves less than its generation costs
# (a few ms) over any plausible number of calls
MIN_TENSORS = 8
# the Python types a TensorMatch accepts (their objects are THPVariables with no custom sizes)
MATCHED_TYPES = (torch.Tensor, nn.Parameter)

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <c10/core/TensorImpl.h>
#include <algorithm>
#include <vector>

namespace {
// where a torch.Tensor object keeps its TensorImpl pointer (torch/csrc/autograd/python_variable.h:
// right after the object's head, or after MaybeOwned's flag in older torch): found by `init`
// from a tensor's `_cdata`, and checked again for every tensor a TensorMatch is made of
Py_ssize_t impl_offset = -1;
PyTypeObject* tensor_base = nullptr;

inline c10::TensorImpl* impl_of(PyObject* o) {
    return *reinterpret_cast<c10::TensorImpl**>(reinterpret_cast<char*>(o) + impl_offset);
}

struct Expected {
    PyTypeObject* type;
    caffe2::TypeMeta dtype;
    c10::Device device;
    std::vector<int64_t> sizes, strides;  // strides empty: contiguous
    bool requires_grad;
};

bool matches(const Expected& e, PyObject* o) {
    if (Py_TYPE(o) != e.type) return false;
    const c10::TensorImpl* t = impl_of(o);
    if (t->layout() != c10::kStrided || t->dtype() != e.dtype || t->device() != e.device) return false;
    c10::IntArrayRef sizes = t->sizes();
    if (sizes.size() != e.sizes.size() || !std::equal(sizes.begin(), sizes.end(), e.sizes.begin())) return false;
    if (e.strides.empty()) {
        if (!t->is_contiguous()) return false;
    } else {
        c10::IntArrayRef strides = t->strides();
        if (!std::equal(strides.begin(), strides.end(), e.strides.begin())) return false;
    }
    return t->requires_grad() == e.requires_grad;
}

struct TensorMatch {
    PyObject_HEAD
    std::vector<Expected>* expected;
    vectorcallfunc vectorcall;
};

// TensorMatch(tensors): the metadata of `tensors` (a tuple) now
PyObject* match_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
    PyObject* tensors;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &tensors)) return nullptr;
    auto expected = new std::vector<Expected>();
    try {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors); i++) {
            PyObject* o = PyTuple_GET_ITEM(tensors, i);
            if (!PyObject_TypeCheck(o, tensor_base)) {
                PyErr_Format(PyExc_TypeError, "item %zd is a %s, not a tensor", i, Py_TYPE(o)->tp_name);
                delete expected;
                return nullptr;
            }
            PyObject* cdata = PyObject_GetAttrString(o, "_cdata");
            if (!cdata) { delete expected; return nullptr; }
            void* impl = PyLong_AsVoidPtr(cdata);
            Py_DECREF(cdata);
            const c10::TensorImpl* t = impl_of(o);
            if (impl != t || t->layout() != c10::kStrided) {
                PyErr_Format(PyExc_TypeError, "item %zd: not a strided tensor as this module reads one", i);
                delete expected;
                return nullptr;
            }
            Expected e{Py_TYPE(o), t->dtype(), t->device(), t->sizes().vec(), {}, t->requires_grad()};
            if (!t->is_contiguous()) e.strides = t->strides().vec();
            expected->push_back(std::move(e));
        }
    } catch (const std::exception& err) {
        PyErr_SetString(PyExc_TypeError, err.what());
        delete expected;
        return nullptr;
    }
    auto self = reinterpret_cast<TensorMatch*>(type->tp_alloc(type, 0));
    if (!self) { delete expected; return nullptr; }
    self->expected = expected;
    self->vectorcall = nullptr;
    return reinterpret_cast<PyObject*>(self);
}

void match_dealloc(PyObject* self) {
    delete reinterpret_cast<TensorMatch*>(self)->expected;
    Py_TYPE(self)->tp_free(self);
}

// match(tensors): True or False; None where an accessor raised (the caller's Python guard decides)
PyObject* match_call(PyObject* self, PyObject* args, PyObject* kwargs) {
    PyObject* tensors;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &tensors)) return nullptr;
    const std::vector<Expected>& expected = *reinterpret_cast<TensorMatch*>(self)->expected;
    if ((size_t)PyTuple_GET_SIZE(tensors) != expected.size()) Py_RETURN_FALSE;
    try {
        for (size_t i = 0; i < expected.size(); i++)
            if (!matches(expected[i], PyTuple_GET_ITEM(tensors, i))) Py_RETURN_FALSE;
    } catch (...) {
        Py_RETURN_NONE;
    }
    Py_RETURN_TRUE;
}

PyTypeObject TensorMatchType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// storages_distinct(items): True when the tensors among `items` have storages at distinct data
// addresses (guards.unshared's first test), else False; None where one has no storage to read
PyObject* storages_distinct(PyObject*, PyObject* items) {
    if (!PyTuple_Check(items)) { PyErr_SetString(PyExc_TypeError, "a tuple"); return nullptr; }
    std::vector<const void*> starts;
    starts.reserve(PyTuple_GET_SIZE(items));
    try {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
            PyObject* o = PyTuple_GET_ITEM(items, i);
            if (!PyObject_TypeCheck(o, tensor_base)) continue;
            const c10::TensorImpl* t = impl_of(o);
            if (!t->has_storage()) Py_RETURN_NONE;
            starts.push_back(t->storage().data());
        }
    } catch (...) {
        Py_RETURN_NONE;
    }
    std::sort(starts.begin(), starts.end());
    if (std::adjacent_find(starts.begin(), starts.end()) != starts.end()) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

// init(tensor_type, probe): where a tensor object keeps its TensorImpl, from `probe`'s `_cdata`
PyObject* init(PyObject*, PyObject* args) {
    PyObject *type, *probe;
    if (!PyArg_ParseTuple(args, "O!O", &PyType_Type, &type, &probe)) return nullptr;
    PyObject* cdata = PyObject_GetAttrString(probe, "_cdata");
    if (!cdata) return nullptr;
    void* impl = PyLong_AsVoidPtr(cdata);
    Py_DECREF(cdata);
    for (Py_ssize_t offset : {Py_ssize_t(sizeof(PyObject)), Py_ssize_t(sizeof(PyObject) + sizeof(void*))}) {
        if (*reinterpret_cast<void**>(reinterpret_cast<char*>(probe) + offset) == impl) {
            impl_offset = offset;
            tensor_base = reinterpret_cast<PyTypeObject*>(type);
            Py_INCREF(type);
            Py_RETURN_NONE;
        }
    }
    PyErr_SetString(PyExc_RuntimeError, "a tensor object keeps its TensorImpl where this module does not look");
    return nullptr;
}

PyMethodDef methods[] = {
    {"init", init, METH_VARARGS, nullptr},
    {"storages_distinct", storages_distinct, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_fl_guards", nullptr, -1, methods};
}  // namespace

PyMODINIT_FUNC PyInit__fl_guards() {
    TensorMatchType.tp_name = "_fl_guards.TensorMatch";
    TensorMatchType.tp_basicsize = sizeof(TensorMatch);
    TensorMatchType.tp_flags = Py_TPFLAGS_DEFAULT;
    TensorMatchType.tp_new = match_new;
    TensorMatchType.tp_dealloc = match_dealloc;
    TensorMatchType.tp_call = match_call;
    if (PyType_Ready(&TensorMatchType) < 0) return nullptr;
    PyObject* m = PyModule_Create(&module_def);
    if (!m) return nullptr;
    Py_INCREF(&TensorMatchType);
    PyModule_AddObject(m, "TensorMatch", reinterpret_cast<PyObject*>(&TensorMatchType));
    return m;
}
"""


class _Native:
    """The extension: built in the background from the first `get()`, loaded once built."""

    def __init__(self):
        self._lock = threading.Lock()
        self._build = None  # (process, temporary .so, final .so)
        self.module = None
        self.failed: str | None = None

    def get(self):
        """The module, or None: not built yet (its build runs), or it cannot be here."""
        if self.module is not None or self.failed is not None:
            return self.module
        with self._lock:
            try:
                self._advance()
            except Exception as e:  # noqa: BLE001 (no native guards: Python's check them)
                self.failed = f"{type(e).__name__}: {e}"
                log.debug("fuselens: guards are checked in Python (%s)", self.failed)
        return self.module

    def _advance(self):
        if self.module is not None or self.failed is not None:
            return
        if self._build is None:
            path = _library_path()
            if not os.path.exists(path):
                self._start(path)
                return
            self._load(path)
            return
        process, tmp, path = self._build
        if process.poll() is None:
            return
        messages = process.stdout.read()
        self._build = None
        if process.returncode != 0:
            raise RuntimeError(f"building the native guards failed:\n{messages[-2000:]}")
        os.replace(tmp, path)
        self._load(path)

    def _start(self, path):
        from ..codegen.cpp_build import compiler
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler")
        include = os.path.join(os.path.dirname(torch.__file__), "include")
        python_include = sysconfig.get_paths()["include"]
        if not os.path.exists(os.path.join(include, "c10", "core", "TensorImpl.h")) or \
                not os.path.exists(os.path.join(python_include, "Python.h")):
            raise RuntimeError("torch's C++ headers or Python.h are not installed")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        stem = f"{path[:-3]}.{os.getpid()}.{threading.get_ident()}"
        with open(stem + ".cpp", "w") as f:
            f.write(SOURCE)
        abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
        lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{include}", f"-I{python_include}", stem + ".cpp", "-o", stem + ".so",
               f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}"]
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._build = (process, stem + ".so", path)
        threading.Thread(target=_reap, args=(process, stem + ".cpp"), daemon=True).start()

    def _load(self, path):
        spec = importlib.util.spec_from_file_location(
            "_fl_guards", path, loader=importlib.machinery.ExtensionFileLoader("_fl_guards", path))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.init(torch._C.TensorBase, torch.empty(1))
        for probe in (nn.Parameter(torch.empty(2, 3)), torch.empty(4)[1:].view(3, 1)):
            module.TensorMatch((probe,))  # raises where the probe's TensorImpl is not found
        self.module = module

    def wait(self, timeout=120.0):
        """The module once its build has finished (tests, a benchmark's warm-up), or None."""
        import time
        end = time.monotonic() + timeout
        while self.get() is None and self.failed is None and time.monotonic() < end:
            time.sleep(0.05)
        return self.module


def _reap(process, source):
    process.wait()
    try:
        os.unlink(source)
    except OSError:
        pass


def _library_path() -> str:
    from ..codegen.cpp_build import compiler_identity
    key = hashlib.sha256("\0".join([
        SOURCE, compiler_identity(), torch.__version__, os.path.dirname(torch.__file__), sys.version,
    ]).encode()).hexdigest()[:24]
    return os.path.join(settings.cache_dir(), "guards", f"_fl_guards_{key}.so")


NATIVE = _Native()


def install(entry, cap) -> None:
    """From `entry`'s first call whose guards hold once the extension is built, its guards are
    checked by the fast guard function (above); `entry.guard_fn` is the Python one until then."""
    if not settings.native_guards() or sum(g.kind == "tensor" for g in cap.guards) < MIN_TENSORS:
        return
    python_guard = entry.guard_fn

    def learning(*args, **kwargs):
        ok = python_guard(*args, **kwargs)
        if ok and NATIVE.get() is not None:
            entry.guard_fn = _fast_guard(cap, entry.guard_namespace, python_guard, args, kwargs) or python_guard
        elif NATIVE.failed is not None:
            entry.guard_fn = python_guard
        return ok
    entry.guard_fn = learning


def _fast_guard(cap, namespace, python_guard, args, kwargs):
    """The fast guard of a capture whose Python guards held for `args` (just now), or None where
    its tensors are not all of MATCHED_TYPES."""
    from ..capture.guards import NATIVE_DISTINCT, NATIVE_MATCH, guard_function
    from ..capture.source import build_function
    native = NATIVE.module
    sig = cap.guard_source.split("\n", 1)[0][len("def __fl_guard("):-len("):")]
    source = guard_function(cap.guards, sig, cap.namespace, native=True)
    collect = build_function(source, "__fl_guard", {**namespace, NATIVE_MATCH: lambda tensors: tensors,
                                                  NATIVE_DISTINCT: native.storages_distinct}, {})
    try:
        tensors = collect(*args, **kwargs)
        if type(tensors) is not tuple or not all(type(t) in MATCHED_TYPES for t in tensors):
            return None
        match = native.TensorMatch(tensors)
    except Exception as e:  # noqa: BLE001 (the Python guard stays)
        log.debug("fuselens: %s keeps its Python guards (%s: %s)", cap.fs.qualname, type(e).__name__, e)
        return None
    fast = build_function(source, "__fl_guard", {**namespace, NATIVE_MATCH: match,
                                               NATIVE_DISTINCT: native.storages_distinct}, {})

    def guard(*args, **kwargs):
        ok = fast(*args, **kwargs)
        return python_guard(*args, **kwargs) if ok is None else ok
    guard.native, guard.python = True, python_guard
    return guard
