"""A cache entry's guards checked in C++: its tensors' in one call, most others in another.

A model's guard function checks every parameter and buffer on every call (type, dtype, device,
shape, contiguity or strides, requires_grad): ~0.26 us a tensor in Python, so a 16-layer decoder's
151 tensors were 47 of its 102 us a call on the dev CPU, the check that an input written in place
shares no storage with another (`guards.unshared`, 175 ns a tensor) 27 more, and each module's
identity, mode, hooks and attributes (~30 ns a condition) the rest. Decoding with reduce-overhead
calls the step once a token, and where the step's inputs are copied from pageable memory the
host's time between steps is the GPU's idle time.

Here they are C++ calls, through a CPython extension built against the running torch's c10
headers (TensorImpl's accessors: ~1 s with g++ 12, once per machine, torch and Python, kept in
`<cache dir>/guards/`, built in the background from the first entry that wants it; until it is
built, or where it cannot be, guards run in Python as before):
- GuardChecks: the guards over sources read from constants (a module's `training`, hooks, a
  submodule's identity, a hyper-parameter's type and value; Reads makes every guarded module a
  constant), each one of a few predicates (`Checks`), read with the same lookups Python makes
  (an nn.Module's own attribute from its dict, where its class's lookup finds it there);
- TensorMatch: the static tensor guards' tensors, read from their module (or passed where they are
  arguments), and, where the entry has guards.unshared's guard, whether they and its other inputs
  lie in distinct storages.

An entry's fast guard is made at its second call whose Python guards hold (`install`): the same
guard function with those guards left out, calling the two. A tensor matches when its Python type,
dtype, device, sizes, strides (where that call's tensor was not contiguous; else contiguity), layout
and requires_grad are that call's tensor's, which is exactly what the left-out guards compared with
their constants (that tensor met them); the checks are the left-out conditions: the fast guard holds
if and only if the Python one does. Where the C++ cannot tell (an exception from a tensor's
accessors, two storages that may be one), it answers None and the Python guard decides.
"""
from __future__ import annotations

import ast
import atexit
import builtins
import functools
import hashlib
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import subprocess
import sys
import sysconfig
import threading

import torch
import torch.nn as nn

from .. import settings
from ..capture.guards import NATIVE_CHECKS, NATIVE_MATCH, arg_index, guard_function
from ..capture.source import build_function
from ..codegen.cpp_build import compiler, compiler_identity

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

// -- sources: an object read from a constant by steps ------------------------------------------
enum { ATTR, ITEM, DICT };  // an attribute, an item, an attribute from the object's own dict

struct Path {
    PyObject* root;
    std::vector<std::pair<int, PyObject*>> steps;
};

void release(Path& p) {
    Py_XDECREF(p.root);
    for (auto& step : p.steps) Py_XDECREF(step.second);
}

// (root, ((kind, key), ...)) into `out`; false with an exception set where it is not that
bool parse_path(PyObject* root, PyObject* steps, Path& out) {
    if (!PyTuple_Check(steps)) { PyErr_SetString(PyExc_TypeError, "steps: a tuple"); return false; }
    out.root = root;
    Py_INCREF(root);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(steps); j++) {
        int kind;
        PyObject* key;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(steps, j), "iO", &kind, &key)) return false;
        Py_INCREF(key);
        out.steps.emplace_back(kind, key);
    }
    return true;
}

// the object at `p` (a new reference), or nullptr where reading it raised (cleared: as a Python
// guard that raises fails)
PyObject* read(const Path& p) {
    PyObject* v = p.root;
    Py_INCREF(v);
    for (const auto& [kind, key] : p.steps) {
        PyObject* next;
        if (kind == ATTR) {
            next = PyObject_GetAttr(v, key);
        } else if (kind == ITEM) {
            next = PyObject_GetItem(v, key);
        } else {  // (where it is not there, the attribute as Python finds it: its class's, __getattr__)
            PyObject* dict = PyObject_GenericGetDict(v, nullptr);
            next = dict ? PyDict_GetItemWithError(dict, key) : nullptr;
            Py_XINCREF(next);
            Py_XDECREF(dict);
            if (!next && !PyErr_Occurred()) next = PyObject_GetAttr(v, key);
        }
        Py_DECREF(v);
        if (!next) { PyErr_Clear(); return nullptr; }
        v = next;
    }
    return v;
}

// -- GuardChecks(checks): guards read from constants (runtime/native_guards.py `Checks`), each
// (root, steps, ((predicate, operand), ...)): the source read once, then each predicate of it
enum { IS, TYPE_IS, EQ, NOT, LEN_EQ };

struct Predicate {
    int kind;
    PyObject* operand;
    Py_ssize_t length;
};

struct Check {
    Path path;
    std::vector<Predicate> predicates;
};

struct GuardChecks {
    PyObject_HEAD
    std::vector<Check>* checks;
};

void release(std::vector<Check>* checks) {
    for (Check& c : *checks) {
        release(c.path);
        for (auto& p : c.predicates) Py_XDECREF(p.operand);
    }
    delete checks;
}

PyObject* checks_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
    PyObject* items;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &items)) return nullptr;
    auto checks = new std::vector<Check>();
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
        PyObject *root, *steps, *predicates;
        checks->emplace_back();
        Check& c = checks->back();
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(items, i), "OOO!", &root, &steps, &PyTuple_Type, &predicates) ||
                !parse_path(root, steps, c.path)) {
            release(checks);
            return nullptr;
        }
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(predicates); j++) {
            int kind;
            PyObject* operand;
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(predicates, j), "iO", &kind, &operand)) { release(checks); return nullptr; }
            Py_INCREF(operand);
            c.predicates.push_back(Predicate{kind, operand, 0});
            if (kind == LEN_EQ) {
                c.predicates.back().length = PyLong_AsSsize_t(operand);
                if (PyErr_Occurred()) { release(checks); return nullptr; }
            }
        }
    }
    auto self = reinterpret_cast<GuardChecks*>(type->tp_alloc(type, 0));
    if (!self) { release(checks); return nullptr; }
    self->checks = checks;
    return reinterpret_cast<PyObject*>(self);
}

// (collected with what it holds: a compiled model's guards hold the model, which may hold them)
int visit_path(Path& p, visitproc visit, void* arg) {
    Py_VISIT(p.root);
    for (auto& step : p.steps) Py_VISIT(step.second);
    return 0;
}

int checks_traverse(PyObject* self, visitproc visit, void* arg) {
    auto checks = reinterpret_cast<GuardChecks*>(self)->checks;
    if (checks) {
        for (Check& c : *checks) {
            if (int r = visit_path(c.path, visit, arg)) return r;
            for (auto& p : c.predicates) Py_VISIT(p.operand);
        }
    }
    return 0;
}

int checks_clear(PyObject* self) {
    auto s = reinterpret_cast<GuardChecks*>(self);
    if (s->checks) release(s->checks);
    s->checks = nullptr;
    return 0;
}

void checks_dealloc(PyObject* self) {
    PyObject_GC_UnTrack(self);
    checks_clear(self);
    Py_TYPE(self)->tp_free(self);
}

// 1 where every predicate holds, in order (as `and` evaluates them); 0 where one does not or
// evaluating it raised
int holds(const Check& c) {
    PyObject* v = read(c.path);
    if (!v) return 0;
    int ok = 1;
    for (const Predicate& p : c.predicates) {
        switch (p.kind) {
            case IS: ok = v == p.operand; break;
            case TYPE_IS: ok = reinterpret_cast<PyObject*>(Py_TYPE(v)) == p.operand; break;
            case EQ: {
                PyObject* r = PyObject_RichCompare(v, p.operand, Py_EQ);
                ok = r ? PyObject_IsTrue(r) : -1;
                Py_XDECREF(r);
                break;
            }
            case NOT: ok = PyObject_Not(v); break;
            case LEN_EQ: {
                Py_ssize_t n = PyObject_Length(v);
                ok = n < 0 ? -1 : n == p.length;
                break;
            }
            default: ok = 0;
        }
        if (ok != 1) break;
    }
    Py_DECREF(v);
    if (ok < 0) { PyErr_Clear(); return 0; }
    return ok;
}

PyObject* checks_call(PyObject* self, PyObject* args, PyObject* kwargs) {
    auto checks = reinterpret_cast<GuardChecks*>(self)->checks;
    if (!checks) Py_RETURN_FALSE;  // (cleared by the collector)
    for (const Check& c : *checks)
        if (!holds(c)) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

PyTypeObject GuardChecksType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// -- TensorMatch(paths, tensors, distinct): the metadata of the tensors at `paths` (read from
// constants) and of `tensors` now; `distinct`: a call also answers whether their storages and
// those of its `others` are at distinct addresses (guards.unshared's first test)
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
    std::vector<Path>* paths;
    std::vector<Expected>* expected;  // the paths' tensors', then the passed tensors'
    bool distinct;
};

void release(TensorMatch* m) {
    if (m->paths) for (Path& p : *m->paths) release(p);
    delete m->paths;
    delete m->expected;
    m->paths = nullptr;
    m->expected = nullptr;
}

int match_traverse(PyObject* self, visitproc visit, void* arg) {
    auto paths = reinterpret_cast<TensorMatch*>(self)->paths;
    if (paths)
        for (Path& p : *paths)
            if (int r = visit_path(p, visit, arg)) return r;
    return 0;
}

int match_clear(PyObject* self) {
    release(reinterpret_cast<TensorMatch*>(self));
    return 0;
}

// the metadata of tensor `o` as a match expects it again; false with an exception set where `o`
// is not a strided tensor this module reads
bool expect(PyObject* o, std::vector<Expected>& out) {
    if (!PyObject_TypeCheck(o, tensor_base)) {
        PyErr_Format(PyExc_TypeError, "a %s, not a tensor", Py_TYPE(o)->tp_name);
        return false;
    }
    PyObject* cdata = PyObject_GetAttrString(o, "_cdata");
    if (!cdata) return false;
    void* impl = PyLong_AsVoidPtr(cdata);
    Py_DECREF(cdata);
    const c10::TensorImpl* t = impl_of(o);
    if (impl != t || t->layout() != c10::kStrided) {
        PyErr_SetString(PyExc_TypeError, "not a strided tensor as this module reads one");
        return false;
    }
    try {
        Expected e{Py_TYPE(o), t->dtype(), t->device(), t->sizes().vec(), {}, t->requires_grad()};
        if (!t->is_contiguous()) e.strides = t->strides().vec();
        out.push_back(std::move(e));
    } catch (const std::exception& err) {
        PyErr_SetString(PyExc_TypeError, err.what());
        return false;
    }
    return true;
}

PyObject* match_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
    PyObject *paths, *tensors;
    int distinct;
    if (!PyArg_ParseTuple(args, "O!O!p", &PyTuple_Type, &paths, &PyTuple_Type, &tensors, &distinct)) return nullptr;
    auto self = reinterpret_cast<TensorMatch*>(type->tp_alloc(type, 0));
    if (!self) return nullptr;
    self->paths = new std::vector<Path>();
    self->expected = new std::vector<Expected>();
    self->distinct = distinct;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(paths); i++) {
        PyObject *root, *steps;
        self->paths->emplace_back();
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(paths, i), "OO", &root, &steps) ||
                !parse_path(root, steps, self->paths->back())) {
            Py_DECREF(self);
            return nullptr;
        }
        PyObject* t = read(self->paths->back());
        if (!t) {
            PyErr_Format(PyExc_LookupError, "path %zd reads nothing", i);
            Py_DECREF(self);
            return nullptr;
        }
        bool ok = expect(t, *self->expected);
        Py_DECREF(t);
        if (!ok) { Py_DECREF(self); return nullptr; }
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors); i++)
        if (!expect(PyTuple_GET_ITEM(tensors, i), *self->expected)) { Py_DECREF(self); return nullptr; }
    return reinterpret_cast<PyObject*>(self);
}

void match_dealloc(PyObject* self) {
    PyObject_GC_UnTrack(self);
    release(reinterpret_cast<TensorMatch*>(self));
    Py_TYPE(self)->tp_free(self);
}

// the storage address of each tensor among `items` (tensors or not) into `starts`; false where
// one has no storage to read
bool storage_starts(PyObject* const* items, Py_ssize_t n, std::vector<const void*>& starts) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyObject_TypeCheck(items[i], tensor_base)) continue;
        const c10::TensorImpl* t = impl_of(items[i]);
        if (!t->has_storage()) return false;
        starts.push_back(t->storage().data());
    }
    return true;
}

// match(tensors, others): True or False; None where an accessor raised, or, for a `distinct`
// match, where two storages may be one (the caller's Python guards decide)
PyObject* match_call(PyObject* self_, PyObject* args, PyObject* kwargs) {
    auto self = reinterpret_cast<TensorMatch*>(self_);
    PyObject *tensors, *others;
    if (!PyArg_ParseTuple(args, "O!O", &PyTuple_Type, &tensors, &others)) return nullptr;
    if (!self->paths) Py_RETURN_NONE;  // (cleared by the collector)
    const std::vector<Expected>& expected = *self->expected;
    size_t n_paths = self->paths->size();
    if (n_paths + PyTuple_GET_SIZE(tensors) != expected.size()) Py_RETURN_FALSE;
    std::vector<PyObject*> read_now;
    read_now.reserve(n_paths);
    int result = 1;  // 1 True, 0 False, -1 None
    try {
        for (size_t i = 0; i < n_paths && result == 1; i++) {
            PyObject* t = read((*self->paths)[i]);
            if (!t) { result = 0; break; }
            read_now.push_back(t);
            if (!matches(expected[i], t)) result = 0;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors) && result == 1; i++)
            if (!matches(expected[n_paths + i], PyTuple_GET_ITEM(tensors, i))) result = 0;
        if (result == 1 && self->distinct) {
            std::vector<const void*> starts;
            starts.reserve(expected.size() + 8);
            bool readable = storage_starts(read_now.data(), read_now.size(), starts) &&
                storage_starts(&PyTuple_GET_ITEM(tensors, 0), PyTuple_GET_SIZE(tensors), starts) &&
                (!PyTuple_Check(others) || storage_starts(&PyTuple_GET_ITEM(others, 0), PyTuple_GET_SIZE(others), starts));
            std::sort(starts.begin(), starts.end());
            if (!readable || std::adjacent_find(starts.begin(), starts.end()) != starts.end()) result = -1;
        }
    } catch (...) {
        result = -1;
    }
    for (PyObject* t : read_now) Py_DECREF(t);
    if (result < 0) Py_RETURN_NONE;
    if (result) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

PyTypeObject TensorMatchType = {PyVarObject_HEAD_INIT(nullptr, 0)};

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
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_fl_guards", nullptr, -1, methods};

bool ready(PyTypeObject& type, const char* name, Py_ssize_t size, newfunc make, destructor free, ternaryfunc call,
           traverseproc traverse, inquiry clear) {
    type.tp_name = name;
    type.tp_basicsize = size;
    type.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
    type.tp_new = make;
    type.tp_dealloc = free;
    type.tp_call = call;
    type.tp_traverse = traverse;
    type.tp_clear = clear;
    type.tp_free = PyObject_GC_Del;
    return PyType_Ready(&type) == 0;
}
}  // namespace

PyMODINIT_FUNC PyInit__fl_guards() {
    if (!ready(TensorMatchType, "_fl_guards.TensorMatch", sizeof(TensorMatch), match_new, match_dealloc, match_call,
               match_traverse, match_clear) ||
            !ready(GuardChecksType, "_fl_guards.GuardChecks", sizeof(GuardChecks), checks_new, checks_dealloc,
                   checks_call, checks_traverse, checks_clear))
        return nullptr;
    PyObject* m = PyModule_Create(&module_def);
    if (!m) return nullptr;
    Py_INCREF(&TensorMatchType);
    PyModule_AddObject(m, "TensorMatch", reinterpret_cast<PyObject*>(&TensorMatchType));
    Py_INCREF(&GuardChecksType);
    PyModule_AddObject(m, "GuardChecks", reinterpret_cast<PyObject*>(&GuardChecksType));
    return m;
}
"""


class _Native:
    """The extension: built in the background from the first `get()`, loaded once built. A build
    still running when the process exits is waited for (atexit), so the next process loads it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._build = None  # the thread that waits for the compiler and installs what it built
        self._messages: list = []  # the compiler's, where it failed
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
        if self.module is not None or self.failed is not None or \
                self._build is not None and self._build.is_alive():
            return
        path = _library_path()
        if os.path.exists(path):
            self._load(path)
        elif self._build is not None:
            raise RuntimeError(f"building the native guards failed:\n{''.join(self._messages)[-2000:]}")
        else:
            self._start(path)

    def _start(self, path):
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
        if sys.platform == "darwin":  # (Python's symbols come from the interpreter that loads it)
            cmd += ["-undefined", "dynamic_lookup"]
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._build = threading.Thread(target=self._finish, args=(process, stem, path), daemon=True)
        self._build.start()

    def _finish(self, process, stem, path):
        messages, _ = process.communicate()
        if process.returncode == 0:
            os.replace(stem + ".so", path)
        else:
            self._messages.append(messages)
        for leftover in (stem + ".cpp", stem + ".so"):
            try:
                os.unlink(leftover)
            except OSError:
                pass

    def _load(self, path):
        spec = importlib.util.spec_from_file_location(
            "_fl_guards", path, loader=importlib.machinery.ExtensionFileLoader("_fl_guards", path))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.init(torch._C.TensorBase, torch.empty(1))
        for probe in (nn.Parameter(torch.empty(2, 3)), torch.empty(4)[1:].view(3, 1)):
            module.TensorMatch((), (probe,), False)  # raises where the probe's TensorImpl is not found
        self.module = module

    def wait(self, timeout=120.0):
        """The module once its build has finished (tests, a benchmark's warm-up), or None."""
        if self.get() is None and self._build is not None:
            self._build.join(timeout)
        return self.get()


def _library_path() -> str:
    key = hashlib.sha256("\0".join([
        SOURCE, compiler_identity(), torch.__version__, os.path.dirname(torch.__file__), sys.version,
    ]).encode()).hexdigest()[:24]
    return os.path.join(settings.cache_dir(), "guards", f"_fl_guards_{key}.so")


NATIVE = _Native()


@atexit.register
def _finish_build():
    if NATIVE._build is not None:
        NATIVE._build.join(120)


def install(entry, cap) -> None:
    """From `entry`'s second call whose guards hold once the extension is built, its guards are
    checked by the fast guard function (above); `entry.guard_fn` is the Python one until then. (Not
    the first: making it takes ~30-75 ms for a ResNet's guards, which a process that takes a kept
    capture would add to its first call, and an entry called once never repays.)"""
    if not settings.native_guards() or sum(g.kind == "tensor" for g in cap.guards) < MIN_TENSORS:
        return
    python_guard = entry.guard_fn
    held = 0

    def learning(*args, **kwargs):
        nonlocal held
        ok = python_guard(*args, **kwargs)
        if ok:
            held += 1
            if NATIVE.get() is not None and held >= 2:  # (the first starts the extension's build)
                entry.guard_fn = _fast_guard(cap, entry.guard_namespace, python_guard, args, kwargs) or python_guard
            elif NATIVE.failed is not None:
                entry.guard_fn = python_guard
        return ok
    entry.guard_fn = learning


# -- guards read from constants, as GuardChecks --------------------------------------------------
ATTR, ITEM, DICT = 0, 1, 2  # a step: an attribute, an item, an attribute from the object's own dict
IS, TYPE_IS, EQ, NOT, LEN_EQ = 0, 1, 2, 3, 4
_NO_VALUE = object()


class Checks:
    """`guard_function`'s `native`: a guard's conditions as GuardChecks' checks, where each is one of
    `P is X`, `type(P) is X`, `P == X`, `not P`, `len(P) == n` (X a literal, a constant or a
    builtin) over a source read from a constant by attributes and literal items (a module guarded
    to be itself is a constant: Reads); None where any is not (it stays Python)."""

    def __init__(self, namespace: dict):
        self.namespace = namespace
        self.tensor_paths: list = []  # (root, steps) of the tensors TensorMatch reads itself

    def tensor(self, chain) -> bool:
        """Whether TensorMatch reads the tensor of a static tensor guard itself (from a constant:
        a module's parameter or buffer), and then its path is the next of `tensor_paths`."""
        path = self._path(chain)
        if path is not None:
            self.tensor_paths.append(path)
        return path is not None

    def _path(self, chain, then=()):
        """(root object, steps) of a source read from a constant by attributes and literal items
        (and then `then`'s), or None."""
        if chain.root not in self.namespace:
            return None
        steps = []
        for parts in chain.parts:  # (each `('', '.name')` or `('', '[key]')`: guards.py Chain)
            step = _step(parts[1]) if len(parts) == 2 and not parts[0] else None
            if step is None:
                return None
            steps.append(step)
        obj = self.namespace[chain.root]
        return obj, _read_steps(obj, tuple(steps) + then)

    def __call__(self, template, chains):
        conjuncts = _conjuncts(template)
        if conjuncts is None:
            return None
        paths: dict = {}  # (placeholder, steps) -> [(predicate, operand)]: one read for all of them
        for predicate, index, steps, operand in conjuncts:
            value = self._value(operand)
            if value is _NO_VALUE:
                return None
            paths.setdefault((index, steps), []).append((predicate, value))
        out = []
        for (index, steps), predicates in paths.items():
            path = self._path(chains[index], steps)
            if path is None:
                return None
            out.append((*path, tuple(predicates)))
        return out

    def _value(self, operand):
        kind, v = operand
        if kind == "literal":
            return v
        if v in self.namespace:
            return self.namespace[v]
        return getattr(builtins, v, _NO_VALUE)


@functools.lru_cache(maxsize=4096)
def _conjuncts(template):
    """(predicate, placeholder, steps after it, operand) of each condition of a template (`and`),
    or None where one is of no predicate above."""
    body = ast.parse(template, mode="eval").body
    parts = body.values if isinstance(body, ast.BoolOp) and isinstance(body.op, ast.And) else [body]
    out = []
    for node in parts:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            path, predicate, operand = _path(node.operand), NOT, ("literal", None)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in (ast.Is, ast.Eq):
            left, right = node.left, node.comparators[0]
            call = left.func.id if isinstance(left, ast.Call) and isinstance(left.func, ast.Name) and \
                len(left.args) == 1 and not left.keywords else None
            if call in ("type", "len"):
                left = left.args[0]
            predicate = {("type", ast.Is): TYPE_IS, ("len", ast.Eq): LEN_EQ, (None, ast.Is): IS,
                         (None, ast.Eq): EQ}.get((call, type(node.ops[0])))
            literal = _literal(right)
            if literal is not _NO_VALUE and (predicate != LEN_EQ or type(literal) is int):
                operand = ("literal", literal)
            elif isinstance(right, ast.Name) and predicate in (IS, TYPE_IS):
                operand = ("name", right.id)
            else:
                return None
            path = _path(left) if predicate is not None else None
        else:
            return None
        index = arg_index(path[0]) if path is not None else None
        if index is None:
            return None
        out.append((predicate, index, path[1], operand))
    return tuple(out)


def _literal(node):
    """The value of a literal (a constant, a tuple of them: a module's `normalized_shape`), or
    _NO_VALUE."""
    if isinstance(node, (ast.Constant, ast.Tuple)):
        try:
            return ast.literal_eval(node)
        except ValueError:
            pass
    return _NO_VALUE


def _path(node):
    """(root name, steps) of a name read by attributes and literal items, or None."""
    steps = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            steps.append((ATTR, node.attr))
        elif isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, (str, int)):
            steps.append((ITEM, node.slice.value))
        else:
            return None
        node = node.value
    return (node.id, tuple(reversed(steps))) if isinstance(node, ast.Name) else None


@functools.lru_cache(maxsize=65536)
def _step(text):
    """(ATTR, name) of `.name`, (ITEM, key) of `[key]` with a literal key, else None."""
    if text.startswith(".") and text[1:].isidentifier():
        return ATTR, text[1:]
    if text.startswith("[") and text.endswith("]"):
        try:
            key = ast.literal_eval(text[1:-1])
        except (ValueError, SyntaxError):
            return None
        return (ITEM, key) if type(key) in (str, int) else None
    return None


def _read_now(root, steps):
    """The object at (root, steps) now, as GuardChecks reads it."""
    for kind, key in steps:
        root = root[key] if kind == ITEM else getattr(root, key)
    return root


def _read_steps(root, steps):
    """`steps` with the first read from the root's own dict where a module's lookup finds it there
    (half the time of nn.Module's attribute lookup, which has a __getattr__)."""
    if steps and steps[0][0] == ATTR and isinstance(root, nn.Module) and steps[0][1] in root.__dict__ and \
            _instance_attribute(type(root), steps[0][1]):
        steps = ((DICT, steps[0][1]),) + steps[1:]
    return tuple((kind, sys.intern(key) if type(key) is str else key) for kind, key in steps)


@functools.lru_cache(maxsize=4096)
def _instance_attribute(cls, name) -> bool:
    """Whether an instance's own `name` is what attribute lookup on `cls` finds (no data descriptor
    of that name on the class, no __getattribute__ of its own)."""
    found = inspect.getattr_static(cls, name, _NO_VALUE)
    descriptor = hasattr(type(found), "__set__") or hasattr(type(found), "__delete__")
    return cls.__getattribute__ is object.__getattribute__ and not descriptor


def _fast_guard(cap, namespace, python_guard, args, kwargs):
    """The fast guard of a capture whose Python guards held for `args` (just now), or None where
    its tensors are not all of MATCHED_TYPES."""
    native = NATIVE.module
    sig = cap.guard_source.split("\n", 1)[0][len("def __fl_guard("):-len("):")]
    checks = Checks(namespace)
    try:
        source, found = guard_function(cap.guards, sig, cap.namespace, native=checks)
        common = {**namespace, NATIVE_CHECKS: native.GuardChecks(tuple(found))}
        collect = build_function(source, "__fl_guard", {**common, NATIVE_MATCH: lambda *parts: parts}, {})
        parts = collect(*args, **kwargs)
        if type(parts) is not tuple:  # (False: the call's guards no longer hold)
            return None
        tensors, others = parts
        read = [_read_now(root, steps) for root, steps in checks.tensor_paths]
        if not all(type(t) in MATCHED_TYPES for t in [*read, *tensors]):
            return None
        match = native.TensorMatch(tuple(checks.tensor_paths), tensors, others is not None)
    except Exception as e:  # noqa: BLE001 (the Python guard stays)
        log.debug("fuselens: %s keeps its Python guards (%s: %s)", cap.fs.qualname, type(e).__name__, e)
        return None
    fast = build_function(source, "__fl_guard", {**common, NATIVE_MATCH: match}, {})

    def guard(*args, **kwargs):
        ok = fast(*args, **kwargs)
        return python_guard(*args, **kwargs) if ok is None else ok
    guard.native, guard.python = True, python_guard
    return guard
