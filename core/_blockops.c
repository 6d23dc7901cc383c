/* Compiled block operations: the per-block loops of the simulated KV cache and the
 * prefix index, over the same Python lists and dicts they keep.
 *
 * Each function does exactly what its reference in blockops.py does (same results,
 * same dict insertion order, same exceptions), one C loop instead of one Python
 * bytecode loop a block. Lists must be exact lists and dicts exact dicts: an
 * OrderedDict keeps its own order beside the dict's, which the PyDict_* calls here
 * would bypass. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The list slot an index names, with Python's negative indexing and bounds check. */
static int
slot_of(PyObject *lst, PyObject *index, Py_ssize_t *out)
{
    Py_ssize_t i = PyNumber_AsSsize_t(index, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred())
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(lst);
    if (i < 0)
        i += n;
    if (i < 0 || i >= n) {
        PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
        return -1;
    }
    *out = i;
    return 0;
}

static void
set_slot(PyObject *lst, Py_ssize_t i, PyObject *value)
{
    Py_INCREF(value);
    PyObject *old = PyList_GET_ITEM(lst, i);
    PyList_SET_ITEM(lst, i, value);
    Py_DECREF(old);
}

static int
check_list(PyObject *lst)
{
    if (!PyList_CheckExact(lst)) {
        PyErr_SetString(PyExc_TypeError, "expected a list");
        return -1;
    }
    return 0;
}

static int
check_dict(PyObject *d)
{
    if (!PyDict_CheckExact(d)) {
        PyErr_SetString(PyExc_TypeError, "expected a dict (not a subclass)");
        return -1;
    }
    return 0;
}

/* The prefix index's holder map: a dict, or the OrderedDict it becomes once trimmed
 * (its least recent entries dropped first). Reads go through the dict either way (an
 * OrderedDict is one); writes to an OrderedDict must go through its own setitem and
 * delitem, which keep its order. */
static int
check_holders(PyObject *d)
{
    if (!PyDict_CheckExact(d) && !PyODict_CheckExact(d)) {
        PyErr_SetString(PyExc_TypeError, "expected a dict or an OrderedDict");
        return -1;
    }
    return 0;
}

static inline int
holders_set(PyObject *d, PyObject *key, PyObject *value)
{
    return PyDict_CheckExact(d) ? PyDict_SetItem(d, key, value) : PyObject_SetItem(d, key, value);
}

static inline int
holders_del(PyObject *d, PyObject *key)
{
    return PyDict_CheckExact(d) ? PyDict_DelItem(d, key) : PyObject_DelItem(d, key);
}

/* A mask as a C long when it is an exact int that fits (the masks of clusters up to 62
 * engines); -1 otherwise (the generic number protocol handles it). */
static inline long
small_mask(PyObject *v)
{
    if (!PyLong_CheckExact(v))
        return -1;
    int overflow;
    long x = PyLong_AsLongAndOverflow(v, &overflow);
    if (overflow || x < 0)
        return -1;
    return x;
}

/* fill(lst, indices, value): lst[i] = value for every i. */
static PyObject *
fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fill(lst, indices, value)");
        return NULL;
    }
    PyObject *lst = args[0], *value = args[2];
    if (check_list(lst) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "indices must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i;
        if (slot_of(lst, items[k], &i) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        set_slot(lst, i, value);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* scatter(lst, indices, values): lst[i] = v for i, v in zip(indices, values). */
static PyObject *
scatter(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "scatter(lst, indices, values)");
        return NULL;
    }
    PyObject *lst = args[0];
    if (check_list(lst) < 0)
        return NULL;
    PyObject *idx = PySequence_Fast(args[1], "indices must be a sequence");
    if (idx == NULL)
        return NULL;
    PyObject *vals = PySequence_Fast(args[2], "values must be a sequence");
    if (vals == NULL) {
        Py_DECREF(idx);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(idx);
    if (PySequence_Fast_GET_SIZE(vals) != n) {
        PyErr_SetString(PyExc_ValueError, "indices and values differ in length");
        goto fail;
    }
    PyObject **is = PySequence_Fast_ITEMS(idx), **vs = PySequence_Fast_ITEMS(vals);
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i;
        if (slot_of(lst, is[k], &i) < 0)
            goto fail;
        set_slot(lst, i, vs[k]);
    }
    Py_DECREF(idx);
    Py_DECREF(vals);
    Py_RETURN_NONE;
fail:
    Py_DECREF(idx);
    Py_DECREF(vals);
    return NULL;
}

/* add_at(lst, indices, delta): lst[i] += delta for every i (in order). */
static PyObject *
add_at(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add_at(lst, indices, delta)");
        return NULL;
    }
    PyObject *lst = args[0], *delta = args[2];
    if (check_list(lst) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "indices must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i;
        if (slot_of(lst, items[k], &i) < 0)
            goto fail;
        PyObject *sum = PyNumber_Add(PyList_GET_ITEM(lst, i), delta);
        if (sum == NULL)
            goto fail;
        PyObject *old = PyList_GET_ITEM(lst, i);
        PyList_SET_ITEM(lst, i, sum);
        Py_DECREF(old);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

/* release(ref, blocks): drop one reference from each block, last block first; the
 * blocks whose count reached zero, in that order. */
static PyObject *
release(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "release(ref, blocks)");
        return NULL;
    }
    PyObject *ref = args[0];
    if (check_list(ref) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "blocks must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *zero = PyList_New(0);
    PyObject *zero_int = NULL, *one = NULL;
    if (zero == NULL)
        goto fail;
    zero_int = PyLong_FromLong(0);
    one = PyLong_FromLong(1);
    if (zero_int == NULL || one == NULL)
        goto fail;
    /* Every count 1 (the request held each block alone): all become 0 together, as
     * the reference's bulk path does (a block listed twice is freed twice there). */
    int all_one = 1;
    for (Py_ssize_t k = 0; k < n; k++) { /* every index checked before any change */
        Py_ssize_t i;
        if (slot_of(ref, items[k], &i) < 0)
            goto fail;
        if (all_one) {
            int eq = PyObject_RichCompareBool(PyList_GET_ITEM(ref, i), one, Py_EQ);
            if (eq < 0)
                goto fail;
            all_one = eq;
        }
    }
    for (Py_ssize_t k = n - 1; k >= 0; k--) {
        Py_ssize_t i;
        if (slot_of(ref, items[k], &i) < 0)
            goto fail;
        if (all_one) {
            set_slot(ref, i, zero_int);
        }
        else {
            PyObject *r = PyNumber_Subtract(PyList_GET_ITEM(ref, i), one);
            if (r == NULL)
                goto fail;
            PyObject *old = PyList_GET_ITEM(ref, i);
            PyList_SET_ITEM(ref, i, r);
            Py_DECREF(old);
            int t = PyObject_IsTrue(r);
            if (t < 0)
                goto fail;
            if (t)
                continue;
        }
        if (PyList_Append(zero, items[k]) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    Py_DECREF(zero_int);
    Py_DECREF(one);
    return zero;
fail:
    Py_DECREF(seq);
    Py_XDECREF(zero);
    Py_XDECREF(zero_int);
    Py_XDECREF(one);
    return NULL;
}

/* del_keys(d, keys): del d[k] for every k, in order (KeyError at the first missing). */
static PyObject *
del_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "del_keys(d, keys)");
        return NULL;
    }
    PyObject *d = args[0];
    if (check_dict(d) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyDict_DelItem(d, items[k]) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* prefix_get(d, keys, limit): [d[k] for the leading keys found in d], at most limit. */
static PyObject *
prefix_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "prefix_get(d, keys, limit)");
        return NULL;
    }
    PyObject *d = args[0];
    if (check_dict(d) < 0)
        return NULL;
    Py_ssize_t limit = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (limit < n)
        n = limit < 0 ? 0 : limit;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = PyDict_GetItemWithError(d, items[k]); /* borrowed */
        if (v == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        if (PyList_Append(out, v) < 0)
            goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

/* prefix_len(d, keys): how many leading keys are in d. */
static PyObject *
prefix_len(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "prefix_len(d, keys)");
        return NULL;
    }
    PyObject *d = args[0];
    if (check_dict(d) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), k = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (; k < n; k++) {
        int has = PyDict_Contains(d, items[k]);
        if (has < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (!has)
            break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(k);
}

/* or_bits(d, keys, bit): every key's mask (0 if absent) gains `bit`; returns how many
 * masks had it already. All masks are read before any is written, as the reference
 * reads them in one pass and writes them in a second. */
static PyObject *
or_bits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "or_bits(d, keys, bit)");
        return NULL;
    }
    PyObject *d = args[0], *bit = args[2];
    if (check_holders(d) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), had = 0, k = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    long sbit = small_mask(bit);
    PyObject **next = PyMem_Malloc(sizeof(PyObject *) * (n ? n : 1));
    if (next == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (; k < n; k++) {
        PyObject *m = PyDict_GetItemWithError(d, items[k]); /* borrowed */
        if (m == NULL) {
            if (PyErr_Occurred())
                goto fail;
            Py_INCREF(bit);
            next[k] = bit; /* 0 | bit */
            continue;
        }
        long mm = small_mask(m);
        if (mm >= 0 && sbit >= 0) {
            had += (mm & sbit) != 0;
            next[k] = PyLong_FromLong(mm | sbit);
            if (next[k] == NULL)
                goto fail;
            continue;
        }
        PyObject *both = PyNumber_And(m, bit);
        if (both == NULL)
            goto fail;
        int t = PyObject_IsTrue(both);
        Py_DECREF(both);
        if (t < 0)
            goto fail;
        had += t;
        next[k] = PyNumber_Or(m, bit);
        if (next[k] == NULL)
            goto fail;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        if (holders_set(d, items[j], next[j]) < 0) {
            for (Py_ssize_t r = j; r < n; r++)
                Py_DECREF(next[r]);
            k = 0;
            goto fail;
        }
        Py_DECREF(next[j]);
    }
    PyMem_Free(next);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(had);
fail:
    for (Py_ssize_t r = 0; r < k; r++)
        Py_DECREF(next[r]);
    PyMem_Free(next);
    Py_DECREF(seq);
    return NULL;
}

/* clear_bits(d, keys, bit): each key holding `bit` loses it, in order (an entry left
 * with no bit is deleted, others keep their place); returns how many lost it. */
static PyObject *
clear_bits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "clear_bits(d, keys, bit)");
        return NULL;
    }
    PyObject *d = args[0], *bit = args[2];
    if (check_holders(d) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *notbit = PyNumber_Invert(bit);
    if (notbit == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), removed = 0;
    long sbit = small_mask(bit);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *m = PyDict_GetItemWithError(d, items[k]); /* borrowed */
        if (m == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        long mm = small_mask(m);
        if (mm >= 0 && sbit >= 0) {
            if (!(mm & sbit))
                continue;
            removed++;
            if (mm == sbit) {
                if (holders_del(d, items[k]) < 0)
                    goto fail;
                continue;
            }
            PyObject *left = PyLong_FromLong(mm & ~sbit);
            int rc = left == NULL ? -1 : holders_set(d, items[k], left);
            Py_XDECREF(left);
            if (rc < 0)
                goto fail;
            continue;
        }
        PyObject *both = PyNumber_And(m, bit);
        if (both == NULL)
            goto fail;
        int t = PyObject_IsTrue(both);
        Py_DECREF(both);
        if (t < 0)
            goto fail;
        if (!t)
            continue;
        removed++;
        PyObject *left = PyNumber_And(m, notbit);
        if (left == NULL)
            goto fail;
        int keep = PyObject_IsTrue(left);
        int rc = keep > 0 ? holders_set(d, items[k], left)
                          : (keep == 0 ? holders_del(d, items[k]) : -1);
        Py_DECREF(left);
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(notbit);
    Py_DECREF(seq);
    return PyLong_FromSsize_t(removed);
fail:
    Py_DECREF(notbit);
    Py_DECREF(seq);
    return NULL;
}

/* match_runs(d, keys): the running AND of the leading keys' masks, stopping at the
 * first absent key or empty AND, as (depth, mask) pairs: the bits the AND lost at
 * each depth (the engines whose prefix ends there), the bits left at the end last. */
static PyObject *
match_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "match_runs(d, keys)");
        return NULL;
    }
    PyObject *d = args[0];
    if (check_holders(d) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), depth = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0), *held = NULL;
    if (out == NULL)
        goto fail;
    for (; depth < n; depth++) {
        PyObject *m = PyDict_GetItemWithError(d, items[depth]); /* borrowed */
        if (m == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break;
        }
        if (held != NULL) {
            long hm = small_mask(held), mm = small_mask(m);
            if (hm >= 0 && mm >= 0 && (hm & mm) == hm)
                continue; /* every engine still holding the prefix holds this block */
        }
        PyObject *cur = held == NULL ? (Py_INCREF(m), m) : PyNumber_And(held, m);
        if (cur == NULL)
            goto fail;
        int t = PyObject_IsTrue(cur);
        if (t <= 0) {
            Py_DECREF(cur);
            if (t < 0)
                goto fail;
            break;
        }
        if (held != NULL) {
            int same = PyObject_RichCompareBool(cur, held, Py_EQ);
            if (same < 0) {
                Py_DECREF(cur);
                goto fail;
            }
            if (!same) {
                PyObject *lost = PyNumber_Xor(held, cur); /* cur is a subset of held */
                PyObject *pair = lost ? Py_BuildValue("(nN)", depth, lost) : NULL;
                if (pair == NULL || PyList_Append(out, pair) < 0) {
                    Py_XDECREF(pair);
                    Py_DECREF(cur);
                    goto fail;
                }
                Py_DECREF(pair);
            }
            Py_DECREF(held);
        }
        held = cur;
    }
    if (held != NULL) {
        PyObject *pair = Py_BuildValue("(nO)", depth, held);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            goto fail;
        }
        Py_DECREF(pair);
        Py_DECREF(held);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(held);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* evict(ref, hash_of, cached, blocks): blocks taken from the free queue for new
 * content: each one's count becomes 1 and the hash it held (if any) is forgotten, in
 * both maps; the forgotten hashes, in block order. */
static PyObject *
evict(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "evict(ref, hash_of, cached, blocks)");
        return NULL;
    }
    PyObject *ref = args[0], *hash_of = args[1], *cached = args[2];
    if (check_list(ref) < 0 || check_list(hash_of) < 0 || check_dict(cached) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[3], "blocks must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *one = PyLong_FromLong(1);
    PyObject *out = PyList_New(0);
    if (one == NULL || out == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t i, j;
        if (slot_of(ref, items[k], &i) < 0 || slot_of(hash_of, items[k], &j) < 0)
            goto fail;
        set_slot(ref, i, one);
        PyObject *h = PyList_GET_ITEM(hash_of, j);
        if (h == Py_None)
            continue;
        if (PyList_Append(out, h) < 0) /* holds h while its slot lets go */
            goto fail;
        set_slot(hash_of, j, Py_None);
        if (PyDict_DelItem(cached, h) < 0)
            goto fail;
    }
    Py_DECREF(one);
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(one);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* register(cached, hash_of, blocks, hashes, lo, hi): cached.setdefault(hashes[k],
 * blocks[k]) for k in [lo, hi). If every hash was new, hash_of[blocks[k]] = hashes[k]
 * for each and None is returned; otherwise hash_of is left alone and the setdefault
 * results are returned (the caller sorts out which blocks are new). */
static PyObject *
register_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "register(cached, hash_of, blocks, hashes, lo, hi)");
        return NULL;
    }
    PyObject *cached = args[0], *hash_of = args[1];
    if (check_dict(cached) < 0 || check_list(hash_of) < 0)
        return NULL;
    Py_ssize_t lo = PyNumber_AsSsize_t(args[4], PyExc_OverflowError);
    Py_ssize_t hi = PyNumber_AsSsize_t(args[5], PyExc_OverflowError);
    if ((lo == -1 || hi == -1) && PyErr_Occurred())
        return NULL;
    PyObject *bs = PySequence_Fast(args[2], "blocks must be a sequence");
    if (bs == NULL)
        return NULL;
    PyObject *hs = PySequence_Fast(args[3], "hashes must be a sequence");
    if (hs == NULL) {
        Py_DECREF(bs);
        return NULL;
    }
    /* The slices' bounds, as Python clamps them. */
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(bs), nh = PySequence_Fast_GET_SIZE(hs);
    if (lo < 0 || hi < lo || hi > nb || hi > nh) {
        PyErr_SetString(PyExc_ValueError, "register: [lo, hi) outside the blocks or hashes");
        goto fail;
    }
    PyObject **b = PySequence_Fast_ITEMS(bs), **h = PySequence_Fast_ITEMS(hs);
    Py_ssize_t before = PyDict_GET_SIZE(cached);
    PyObject *got = PyList_New(hi - lo);
    if (got == NULL)
        goto fail;
    for (Py_ssize_t k = lo; k < hi; k++) {
        PyObject *g = PyDict_SetDefault(cached, h[k], b[k]); /* borrowed */
        if (g == NULL) {
            Py_DECREF(got);
            goto fail;
        }
        Py_INCREF(g);
        PyList_SET_ITEM(got, k - lo, g);
    }
    if (PyDict_GET_SIZE(cached) - before != hi - lo) {
        Py_DECREF(bs);
        Py_DECREF(hs);
        return got;
    }
    Py_DECREF(got);
    for (Py_ssize_t k = lo; k < hi; k++) {
        Py_ssize_t i;
        if (slot_of(hash_of, b[k], &i) < 0)
            goto fail;
        set_slot(hash_of, i, h[k]);
    }
    Py_DECREF(bs);
    Py_DECREF(hs);
    Py_RETURN_NONE;
fail:
    Py_DECREF(bs);
    Py_DECREF(hs);
    return NULL;
}

/* hash_run(parent, stream, start, count, step): the chain h_k = hash((h_{k-1}, stream,
 * start + k * step)) for k < count, from h_{-1} = parent (Python's tuple hash, so the
 * same numbers as the reference's comprehension). */
static PyObject *
hash_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "hash_run(parent, stream, start, count, step)");
        return NULL;
    }
    PyObject *stream = args[1];
    Py_ssize_t count = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(count > 0 ? count : 0);
    if (out == NULL)
        return NULL;
    PyObject *h = args[0], *off = args[2], *step = args[4];
    Py_INCREF(h);
    Py_INCREF(off);
    for (Py_ssize_t k = 0; k < count; k++) {
        if (k > 0) {
            PyObject *next = PyNumber_Add(off, step);
            if (next == NULL)
                goto fail;
            Py_SETREF(off, next);
        }
        PyObject *key = PyTuple_Pack(3, h, stream, off);
        if (key == NULL)
            goto fail;
        Py_hash_t v = PyObject_Hash(key);
        Py_DECREF(key);
        if (v == -1 && PyErr_Occurred())
            goto fail;
        PyObject *hv = PyLong_FromSsize_t(v);
        if (hv == NULL)
            goto fail;
        Py_INCREF(hv);
        PyList_SET_ITEM(out, k, hv);
        Py_SETREF(h, hv);
    }
    Py_DECREF(h);
    Py_DECREF(off);
    return out;
fail:
    Py_DECREF(h);
    Py_DECREF(off);
    Py_DECREF(out);
    return NULL;
}

/* a < b as Python says it; exact floats (the use times) compared in C. */
static inline int
less_than(PyObject *a, PyObject *b)
{
    if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b))
        return PyFloat_AS_DOUBLE(a) < PyFloat_AS_DOUBLE(b);
    return PyObject_RichCompareBool(a, b, Py_LT);
}

/* retain_uses(retained, hashes, use_at): one more use at use_at for each hash, in
 * order: a new list [use_at], or use_at inserted into the hash's sorted list (at the
 * front when sooner than its first use, else after every use not later, as
 * bisect.insort). Returns the set of hashes whose first use became sooner. */
static PyObject *
retain_uses(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "retain_uses(retained, hashes, use_at)");
        return NULL;
    }
    PyObject *retained = args[0], *use_at = args[2];
    if (check_dict(retained) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *sooner = PySet_New(NULL);
    if (sooner == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *h = items[k];
        PyObject *uses = PyDict_GetItemWithError(retained, h); /* borrowed */
        if (uses == NULL) {
            if (PyErr_Occurred())
                goto fail;
            PyObject *fresh = PyList_New(1);
            if (fresh == NULL)
                goto fail;
            Py_INCREF(use_at);
            PyList_SET_ITEM(fresh, 0, use_at);
            int rc = PyDict_SetItem(retained, h, fresh);
            Py_DECREF(fresh);
            if (rc < 0)
                goto fail;
            continue;
        }
        if (check_list(uses) < 0)
            goto fail;
        Py_INCREF(uses); /* comparisons below may run Python code */
        Py_ssize_t m = PyList_GET_SIZE(uses);
        if (m == 0) {
            Py_DECREF(uses);
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto fail;
        }
        int lt = less_than(use_at, PyList_GET_ITEM(uses, 0));
        if (lt < 0) {
            Py_DECREF(uses);
            goto fail;
        }
        if (lt) {
            if (PyList_Insert(uses, 0, use_at) < 0 || PySet_Add(sooner, h) < 0) {
                Py_DECREF(uses);
                goto fail;
            }
            Py_DECREF(uses);
            continue;
        }
        /* bisect_right: the first position whose item is greater than use_at. */
        Py_ssize_t lo = 0, hi = PyList_GET_SIZE(uses);
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            PyObject *item = PyList_GET_ITEM(uses, mid);
            Py_INCREF(item);
            int less = less_than(use_at, item);
            Py_DECREF(item);
            if (less < 0) {
                Py_DECREF(uses);
                goto fail;
            }
            if (less)
                hi = mid;
            else
                lo = mid + 1;
            if (hi > PyList_GET_SIZE(uses))
                hi = PyList_GET_SIZE(uses);
        }
        int rc = PyList_Insert(uses, lo, use_at);
        Py_DECREF(uses);
        if (rc < 0)
            goto fail;
    }
    Py_DECREF(seq);
    return sooner;
fail:
    Py_DECREF(seq);
    Py_XDECREF(sooner);
    return NULL;
}

/* Python's `a == b` / `a != b` as a truth value (no identity shortcut, unlike
 * PyObject_RichCompareBool). */
static int
compare_is_true(PyObject *a, PyObject *b, int op)
{
    if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b)) {
        double x = PyFloat_AS_DOUBLE(a), y = PyFloat_AS_DOUBLE(b);
        return op == Py_EQ ? x == y : x != y;
    }
    PyObject *r = PyObject_RichCompare(a, b, op);
    if (r == NULL)
        return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* release_uses(retained, hashes, use_at): undo one retain_uses: in order, a hash
 * absent is skipped; one with a single use is deleted (into `gone`); one whose first
 * use is use_at loses it (into `moved` when its new first use differs); otherwise
 * use_at is removed from its list (ValueError if absent). Returns (gone, moved). */
static PyObject *
release_uses(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "release_uses(retained, hashes, use_at)");
        return NULL;
    }
    PyObject *retained = args[0], *use_at = args[2];
    if (check_dict(retained) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *gone = PyList_New(0), *moved = PyList_New(0), *uses = NULL;
    if (gone == NULL || moved == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *h = items[k];
        uses = PyDict_GetItemWithError(retained, h);
        if (uses == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        if (check_list(uses) < 0) {
            uses = NULL;
            goto fail;
        }
        Py_INCREF(uses);
        Py_ssize_t m = PyList_GET_SIZE(uses);
        if (m == 1) {
            if (PyDict_DelItem(retained, h) < 0 || PyList_Append(gone, h) < 0)
                goto fail;
            Py_CLEAR(uses);
            continue;
        }
        if (m == 0) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto fail;
        }
        int eq = compare_is_true(PyList_GET_ITEM(uses, 0), use_at, Py_EQ);
        if (eq < 0)
            goto fail;
        if (eq) {
            if (PyList_SetSlice(uses, 0, 1, NULL) < 0)
                goto fail;
            if (PyList_GET_SIZE(uses) == 0) {
                PyErr_SetString(PyExc_IndexError, "list index out of range");
                goto fail;
            }
            int ne = compare_is_true(PyList_GET_ITEM(uses, 0), use_at, Py_NE);
            if (ne < 0)
                goto fail;
            if (ne && PyList_Append(moved, h) < 0)
                goto fail;
        }
        else { /* uses.remove(use_at): the first item equal (identity first) */
            Py_ssize_t j = 0;
            for (; j < PyList_GET_SIZE(uses); j++) {
                PyObject *item = PyList_GET_ITEM(uses, j);
                Py_INCREF(item);
                int same = item == use_at ? 1 : compare_is_true(item, use_at, Py_EQ);
                Py_DECREF(item);
                if (same < 0)
                    goto fail;
                if (same)
                    break;
            }
            if (j == PyList_GET_SIZE(uses)) {
                PyErr_SetString(PyExc_ValueError, "list.remove(x): x not in list");
                goto fail;
            }
            if (PyList_SetSlice(uses, j, j + 1, NULL) < 0)
                goto fail;
        }
        Py_CLEAR(uses);
    }
    Py_DECREF(seq);
    PyObject *out = PyTuple_Pack(2, gone, moved);
    Py_DECREF(gone);
    Py_DECREF(moved);
    return out;
fail:
    Py_DECREF(seq);
    Py_XDECREF(uses);
    Py_XDECREF(gone);
    Py_XDECREF(moved);
    return NULL;
}

/* free_cached(cached, ref, run_of, hashes, want, also_type, also): for each hash in
 * order, the block cached[h] when present, its count ref[b] is 0 (false), it is not
 * listed yet, and type(run_of[b]) is `want`, or (with `also` non-empty) is `also_type`
 * and h is in `also`. */
static PyObject *
free_cached(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "free_cached(cached, ref, run_of, hashes, want, also_type, also)");
        return NULL;
    }
    PyObject *cached = args[0], *ref = args[1], *run_of = args[2];
    PyObject *want = args[4], *also_type = args[5], *also = args[6];
    if (check_dict(cached) < 0 || check_list(ref) < 0 || check_list(run_of) < 0)
        return NULL;
    int use_also = PyObject_IsTrue(also);
    if (use_also < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[3], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(0), *seen = PySet_New(NULL);
    if (out == NULL || seen == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *h = items[k];
        PyObject *b = PyDict_GetItemWithError(cached, h); /* borrowed */
        if (b == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        Py_ssize_t i;
        if (slot_of(ref, b, &i) < 0)
            goto fail;
        int held = PyObject_IsTrue(PyList_GET_ITEM(ref, i));
        if (held < 0)
            goto fail;
        if (held)
            continue;
        int dup = PySet_Contains(seen, b);
        if (dup < 0)
            goto fail;
        if (dup)
            continue;
        if (slot_of(run_of, b, &i) < 0)
            goto fail;
        PyObject *kind = (PyObject *)Py_TYPE(PyList_GET_ITEM(run_of, i));
        int take = kind == want;
        if (!take && use_also && kind == also_type) {
            take = PySequence_Contains(also, h);
            if (take < 0)
                goto fail;
        }
        if (take && (PySet_Add(seen, b) < 0 || PyList_Append(out, b) < 0))
            goto fail;
    }
    Py_DECREF(seq);
    Py_DECREF(seen);
    return out;
fail:
    Py_DECREF(seq);
    Py_XDECREF(out);
    Py_XDECREF(seen);
    return NULL;
}

/* set_bits(out, mask, value): out[i] = value for every set bit i of mask, lowest
 * first (IndexError at the first bit past the list, the lower ones set). */
static PyObject *
set_bits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "set_bits(out, mask, value)");
        return NULL;
    }
    PyObject *out = args[0], *mask = args[1], *value = args[2];
    if (check_list(out) < 0)
        return NULL;
    if (PyLong_CheckExact(mask) && Py_SIZE(mask) >= 0) {
        /* A non-negative int: read its bytes once, little end first. */
        size_t nbits = _PyLong_NumBits(mask);
        if (nbits == (size_t)-1 && PyErr_Occurred())
            return NULL;
        size_t nbytes = (nbits + 7) / 8;
        if (nbytes == 0)
            Py_RETURN_NONE;
        unsigned char *buf = PyMem_Malloc(nbytes);
        if (buf == NULL)
            return PyErr_NoMemory();
        if (_PyLong_AsByteArray((PyLongObject *)mask, buf, nbytes, 1, 0) < 0) {
            PyMem_Free(buf);
            return NULL;
        }
        Py_ssize_t n = PyList_GET_SIZE(out);
        for (size_t byte = 0; byte < nbytes; byte++) {
            unsigned char c = buf[byte];
            while (c) {
                int low = __builtin_ctz(c);
                c &= (unsigned char)(c - 1);
                Py_ssize_t i = (Py_ssize_t)(byte * 8 + low);
                if (i >= n) {
                    PyMem_Free(buf);
                    PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
                    return NULL;
                }
                set_slot(out, i, value);
            }
        }
        PyMem_Free(buf);
        Py_RETURN_NONE;
    }
    /* Anything else: the reference's loop, through the number protocol. */
    Py_INCREF(mask);
    for (;;) {
        int t = PyObject_IsTrue(mask);
        if (t < 0)
            goto fail;
        if (!t)
            break;
        PyObject *neg = PyNumber_Negative(mask);
        if (neg == NULL)
            goto fail;
        PyObject *low = PyNumber_And(mask, neg);
        Py_DECREF(neg);
        if (low == NULL)
            goto fail;
        PyObject *len = PyObject_CallMethod(low, "bit_length", NULL);
        if (len == NULL) {
            Py_DECREF(low);
            goto fail;
        }
        Py_ssize_t i = PyNumber_AsSsize_t(len, PyExc_IndexError);
        Py_DECREF(len);
        if (i == -1 && PyErr_Occurred()) {
            Py_DECREF(low);
            goto fail;
        }
        Py_ssize_t at;
        PyObject *index = PyLong_FromSsize_t(i - 1);
        if (index == NULL || slot_of(out, index, &at) < 0) {
            Py_XDECREF(index);
            Py_DECREF(low);
            goto fail;
        }
        Py_DECREF(index);
        set_slot(out, at, value);
        PyObject *rest = PyNumber_Xor(mask, low);
        Py_DECREF(low);
        if (rest == NULL)
            goto fail;
        Py_SETREF(mask, rest);
    }
    Py_DECREF(mask);
    Py_RETURN_NONE;
fail:
    Py_DECREF(mask);
    return NULL;
}

static PyMethodDef methods[] = {
    {"fill", (PyCFunction)(void (*)(void))fill, METH_FASTCALL, NULL},
    {"scatter", (PyCFunction)(void (*)(void))scatter, METH_FASTCALL, NULL},
    {"add_at", (PyCFunction)(void (*)(void))add_at, METH_FASTCALL, NULL},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL, NULL},
    {"del_keys", (PyCFunction)(void (*)(void))del_keys, METH_FASTCALL, NULL},
    {"prefix_get", (PyCFunction)(void (*)(void))prefix_get, METH_FASTCALL, NULL},
    {"prefix_len", (PyCFunction)(void (*)(void))prefix_len, METH_FASTCALL, NULL},
    {"or_bits", (PyCFunction)(void (*)(void))or_bits, METH_FASTCALL, NULL},
    {"clear_bits", (PyCFunction)(void (*)(void))clear_bits, METH_FASTCALL, NULL},
    {"match_runs", (PyCFunction)(void (*)(void))match_runs, METH_FASTCALL, NULL},
    {"evict", (PyCFunction)(void (*)(void))evict, METH_FASTCALL, NULL},
    {"register", (PyCFunction)(void (*)(void))register_run, METH_FASTCALL, NULL},
    {"hash_run", (PyCFunction)(void (*)(void))hash_run, METH_FASTCALL, NULL},
    {"retain_uses", (PyCFunction)(void (*)(void))retain_uses, METH_FASTCALL, NULL},
    {"release_uses", (PyCFunction)(void (*)(void))release_uses, METH_FASTCALL, NULL},
    {"set_bits", (PyCFunction)(void (*)(void))set_bits, METH_FASTCALL, NULL},
    {"free_cached", (PyCFunction)(void (*)(void))free_cached, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockops",
    "Compiled block operations (reference: wasma.core.blockops).", -1, methods,
};

PyMODINIT_FUNC
PyInit__blockops(void)
{
    return PyModule_Create(&module);
}
