/* telemetry._otlp: the OTLP span encoder's hot loop in C (optional; see telemetry/otlp.py).
 *
 * record(r, any_value) encodes one span tree record (telemetry.otlp.to_record) into the
 * same bytes as the pure-Python Encoder.record, field for field: Span (trace_id 1,
 * span_id 2, trace_state 3, parent_span_id 4, name 5, kind 6, start 7, end 8,
 * attributes 9, events 11, links 13, status 15, flags 16), one per span, each framed as
 * ScopeSpans.spans (2). Values it does not know natively (a Mapping that is not a dict, a
 * Sequence that is not a list or tuple, any other object) go to `any_value`, the Python
 * encoder of an AnyValue, so both encoders agree on every input. tests/telemetry checks
 * that they do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *ZERO; /* 0, for sign checks */

typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

static int buf_grow(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra)
        cap *= 2;
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static void buf_free(Buf *b) {
    PyMem_Free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

static int put(Buf *b, const void *src, Py_ssize_t n) {
    if (buf_grow(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, src, (size_t)n);
    b->len += n;
    return 0;
}

static int put_byte(Buf *b, unsigned char c) { return put(b, &c, 1); }

static int put_varint(Buf *b, uint64_t v) {
    unsigned char tmp[10];
    int n = 0;
    while (v >= 0x80) {
        tmp[n++] = (unsigned char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    tmp[n++] = (unsigned char)v;
    return put(b, tmp, n);
}

static int put_fixed64(Buf *b, uint64_t v) {
    unsigned char tmp[8];
    for (int i = 0; i < 8; i++)
        tmp[i] = (unsigned char)(v >> (8 * i));
    return put(b, tmp, 8);
}

static int put_fixed32(Buf *b, uint32_t v) {
    unsigned char tmp[4];
    for (int i = 0; i < 4; i++)
        tmp[i] = (unsigned char)(v >> (8 * i));
    return put(b, tmp, 4);
}

/* A length-delimited field: tag byte (field < 16, wire type 2), varint length, payload. */
static int put_ld(Buf *b, int field, const char *payload, Py_ssize_t n) {
    if (put_byte(b, (unsigned char)(field << 3 | 2)) < 0 || put_varint(b, (uint64_t)n) < 0)
        return -1;
    return put(b, payload, n);
}

/* A nested message written in place: the tag and a one-byte length go first, and
 * end_ld() patches the length, moving the payload up when its length takes more than
 * one byte. Returns the payload's offset. */
static Py_ssize_t begin_ld(Buf *b, int field) {
    if (buf_grow(b, 2) < 0)
        return -1;
    b->data[b->len++] = (char)(field << 3 | 2);
    b->data[b->len++] = 0;
    return b->len;
}

static int end_ld(Buf *b, Py_ssize_t start) {
    uint64_t n = (uint64_t)(b->len - start);
    if (n < 0x80) {
        b->data[start - 1] = (char)n;
        return 0;
    }
    unsigned char tmp[10];
    int k = 0;
    for (uint64_t v = n; v >= 0x80; v >>= 7)
        tmp[k++] = (unsigned char)((v & 0x7F) | 0x80);
    tmp[k] = (unsigned char)(n >> (7 * k));
    k++;
    if (buf_grow(b, k - 1) < 0)
        return -1;
    memmove(b->data + start + k - 1, b->data + start, (size_t)n);
    memcpy(b->data + start - 1, tmp, (size_t)k);
    b->len += k - 1;
    return 0;
}

/* str.encode("utf-8", "replace"), as a string field. */
static int put_str(Buf *b, int field, PyObject *s) {
    if (!PyUnicode_Check(s)) {
        PyErr_Format(PyExc_TypeError, "expected str, got %.100s", Py_TYPE(s)->tp_name);
        return -1;
    }
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(s, &n);
    if (utf8 != NULL)
        return put_ld(b, field, utf8, n);
    PyErr_Clear(); /* lone surrogates: encode with replacement, as Python's encoder does */
    PyObject *bytes = PyUnicode_AsEncodedString(s, "utf-8", "replace");
    if (bytes == NULL)
        return -1;
    int rc = put_ld(b, field, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes));
    Py_DECREF(bytes);
    return rc;
}

/* int.to_bytes(width, "big") for width 8 or 16. */
static int put_id(Buf *b, PyObject *v, int width) {
    unsigned char tmp[16];
    if (!PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "an id must be an int");
        return -1;
    }
    int negative = PyObject_RichCompareBool(v, ZERO, Py_LT);
    if (negative < 0)
        return -1;
    if (negative) {
        PyErr_SetString(PyExc_OverflowError, "can't convert negative int to unsigned");
        return -1;
    }
    uint64_t lo, hi = 0;
    if (width == 8) {
        lo = PyLong_AsUnsignedLongLong(v);
        if (lo == (uint64_t)-1 && PyErr_Occurred())
            return -1;
    } else {
        lo = PyLong_AsUnsignedLongLongMask(v);
        PyObject *shift = PyLong_FromLong(64);
        if (shift == NULL)
            return -1;
        PyObject *high = PyNumber_Rshift(v, shift);
        Py_DECREF(shift);
        if (high == NULL)
            return -1;
        hi = PyLong_AsUnsignedLongLong(high);
        Py_DECREF(high);
        if (hi == (uint64_t)-1 && PyErr_Occurred())
            return -1;
    }
    int k = 0;
    if (width == 16)
        for (int i = 7; i >= 0; i--)
            tmp[k++] = (unsigned char)(hi >> (8 * i));
    for (int i = 7; i >= 0; i--)
        tmp[k++] = (unsigned char)(lo >> (8 * i));
    return put(b, tmp, width);
}

static int as_u64(PyObject *v, uint64_t *out) {
    *out = PyLong_AsUnsignedLongLong(v);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int any_value(Buf *b, PyObject *v, PyObject *fallback);

/* KeyValue: key 1, value 2 (the body, without its own tag). */
static int key_value(Buf *b, PyObject *key, PyObject *v, PyObject *fallback) {
    Py_ssize_t at;
    if (put_str(b, 1, key) < 0 || (at = begin_ld(b, 2)) < 0 || any_value(b, v, fallback) < 0)
        return -1;
    return end_ld(b, at);
}

/* AnyValue: string 1, bool 2, int 3, double 4, array 5, kvlist 6, bytes 7. */
static int any_value(Buf *b, PyObject *v, PyObject *fallback) {
    if (PyUnicode_Check(v))
        return put_str(b, 1, v);
    if (PyBool_Check(v))
        return put_byte(b, 0x10) < 0 ? -1 : put_byte(b, v == Py_True ? 1 : 0);
    if (PyLong_Check(v)) {
        uint64_t u = PyLong_AsUnsignedLongLongMask(v); /* int64: two's complement */
        if (u == (uint64_t)-1 && PyErr_Occurred())
            return -1;
        return put_byte(b, 0x18) < 0 ? -1 : put_varint(b, u);
    }
    if (PyFloat_Check(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        uint64_t u;
        memcpy(&u, &d, 8);
        return put_byte(b, 0x21) < 0 ? -1 : put_fixed64(b, u);
    }
    if (PyBytes_Check(v))
        return put_ld(b, 7, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v));
    if (PyDict_Check(v)) { /* kvlist: values 1 = KeyValue, keys as str(k) */
        Py_ssize_t list = begin_ld(b, 6), pos = 0, at;
        PyObject *k, *item;
        if (list < 0)
            return -1;
        while (PyDict_Next(v, &pos, &k, &item)) {
            if ((at = begin_ld(b, 1)) < 0)
                return -1;
            Py_INCREF(item); /* str(k) runs Python code */
            PyObject *ks = PyObject_Str(k);
            int rc = ks == NULL ? -1 : key_value(b, ks, item, fallback);
            Py_XDECREF(ks);
            Py_DECREF(item);
            if (rc < 0 || end_ld(b, at) < 0)
                return -1;
        }
        return end_ld(b, list);
    }
    if (PyList_Check(v) || PyTuple_Check(v)) { /* array: values 1 = AnyValue */
        Py_ssize_t arr = begin_ld(b, 5), at;
        if (arr < 0)
            return -1;
        /* by index each time: a list could change size while an item is encoded */
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(v); i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(v, i);
            Py_INCREF(item);
            int rc = (at = begin_ld(b, 1)) < 0 || any_value(b, item, fallback) < 0
                     || end_ld(b, at) < 0;
            Py_DECREF(item);
            if (rc)
                return -1;
        }
        return end_ld(b, arr);
    }
    /* anything else (bytearray, other Mappings and Sequences, objects): the Python encoder */
    PyObject *encoded = PyObject_CallOneArg(fallback, v);
    if (encoded == NULL)
        return -1;
    if (!PyBytes_Check(encoded)) {
        Py_DECREF(encoded);
        PyErr_SetString(PyExc_TypeError, "any_value must return bytes");
        return -1;
    }
    int rc = put(b, PyBytes_AS_STRING(encoded), PyBytes_GET_SIZE(encoded));
    Py_DECREF(encoded);
    return rc;
}

/* Repeated KeyValue fields numbered `field`, in the dict's order; None values are left
 * out (the API drops them). */
static int attributes(Buf *b, int field, PyObject *attrs, PyObject *fallback) {
    if (!PyDict_Check(attrs)) {
        PyErr_SetString(PyExc_TypeError, "attributes must be a dict");
        return -1;
    }
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(attrs, &pos, &k, &v)) {
        Py_ssize_t at;
        if (v == Py_None)
            continue;
        Py_INCREF(k); /* the fallback encoder runs Python code */
        Py_INCREF(v);
        int rc = (at = begin_ld(b, field)) < 0 || key_value(b, k, v, fallback) < 0
                 || end_ld(b, at) < 0;
        Py_DECREF(k);
        Py_DECREF(v);
        if (rc)
            return -1;
    }
    return 0;
}

static int name_kind(Buf *b, PyObject *name, PyObject *kind) {
    long k = PyLong_AsLong(kind);
    if (k == -1 && PyErr_Occurred())
        return -1;
    if (k < 0 || k > 5) {
        PyErr_SetString(PyExc_IndexError, "span kind out of range");
        return -1;
    }
    if (put_str(b, 5, name) < 0 || put_byte(b, 0x30) < 0)
        return -1;
    return put_byte(b, (unsigned char)k);
}

static int times(Buf *b, PyObject *start, PyObject *end, int root) {
    uint64_t s, e;
    if (as_u64(start, &s) < 0 || as_u64(end, &e) < 0)
        return -1;
    if (root && e == 0)
        e = s; /* a root still open: `end or start`; a child always has both */
    if (put_byte(b, 0x39) < 0 || put_fixed64(b, s) < 0 || put_byte(b, 0x41) < 0)
        return -1;
    return put_fixed64(b, e);
}

static int flags_field(Buf *b, PyObject *flags, uint32_t extra) {
    unsigned long f = PyLong_AsUnsignedLong(flags);
    if (f == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (put_byte(b, 0x85) < 0 || put_byte(b, 0x01) < 0)
        return -1;
    return put_fixed32(b, (uint32_t)f | 0x100 | extra);
}

static int encode(Buf *out, PyObject *r, PyObject *fallback) {
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 17) {
        PyErr_SetString(PyExc_TypeError, "a span record is a 17-tuple (to_record)");
        return -1;
    }
    PyObject *trace_id = PyTuple_GET_ITEM(r, 1), *span_id = PyTuple_GET_ITEM(r, 2),
             *flags = PyTuple_GET_ITEM(r, 3), *state = PyTuple_GET_ITEM(r, 4),
             *parent_id = PyTuple_GET_ITEM(r, 5), *parent_remote = PyTuple_GET_ITEM(r, 6),
             *name = PyTuple_GET_ITEM(r, 7), *kind = PyTuple_GET_ITEM(r, 8),
             *start = PyTuple_GET_ITEM(r, 9), *end = PyTuple_GET_ITEM(r, 10),
             *attrs = PyTuple_GET_ITEM(r, 11), *events = PyTuple_GET_ITEM(r, 12),
             *links = PyTuple_GET_ITEM(r, 13), *status_code = PyTuple_GET_ITEM(r, 14),
             *status_message = PyTuple_GET_ITEM(r, 15), *children = PyTuple_GET_ITEM(r, 16);
    /* the parts every span of the tree shares: trace id field, the state field */
    Buf ids = {0}, st = {0};
    Py_ssize_t at, sub;
    int rc = -1, t;
    PyObject *seq = NULL;
    if (put_byte(&ids, 0x0a) < 0 || put_byte(&ids, 0x10) < 0 || put_id(&ids, trace_id, 16) < 0)
        goto done;
    if ((t = PyObject_IsTrue(state)) < 0 || (t && put_str(&st, 3, state) < 0))
        goto done;
    /* the root */
    if ((at = begin_ld(out, 2)) < 0 || put(out, ids.data, ids.len) < 0
        || put_byte(out, 0x12) < 0 || put_byte(out, 0x08) < 0 || put_id(out, span_id, 8) < 0
        || put(out, st.data ? st.data : "", st.len) < 0)
        goto done;
    if ((t = PyObject_IsTrue(parent_id)) < 0)
        goto done;
    if (t && (put_byte(out, 0x22) < 0 || put_byte(out, 0x08) < 0
              || put_id(out, parent_id, 8) < 0))
        goto done;
    if (name_kind(out, name, kind) < 0 || times(out, start, end, 1) < 0)
        goto done;
    if ((t = PyObject_IsTrue(attrs)) < 0 || (t && attributes(out, 9, attrs, fallback) < 0))
        goto done;
    if ((seq = PySequence_Fast(events, "events must be a sequence")) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *ev = PySequence_Fast_GET_ITEM(seq, i); /* (name, time, attributes) */
        uint64_t ts;
        if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != 3) {
            PyErr_SetString(PyExc_TypeError, "an event is (name, time_ns, attributes)");
            goto done;
        }
        PyObject *ea = PyTuple_GET_ITEM(ev, 2);
        if (as_u64(PyTuple_GET_ITEM(ev, 1), &ts) < 0 || (sub = begin_ld(out, 11)) < 0
            || put_byte(out, 0x09) < 0 || put_fixed64(out, ts) < 0
            || put_str(out, 2, PyTuple_GET_ITEM(ev, 0)) < 0
            || (t = PyObject_IsTrue(ea)) < 0 || (t && attributes(out, 3, ea, fallback) < 0)
            || end_ld(out, sub) < 0)
            goto done;
    }
    Py_CLEAR(seq);
    if ((seq = PySequence_Fast(links, "links must be a sequence")) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *lk = PySequence_Fast_GET_ITEM(seq, i); /* (trace_id, span_id, attrs) */
        if (!PyTuple_Check(lk) || PyTuple_GET_SIZE(lk) != 3) {
            PyErr_SetString(PyExc_TypeError, "a link is (trace_id, span_id, attributes)");
            goto done;
        }
        PyObject *la = PyTuple_GET_ITEM(lk, 2);
        if ((sub = begin_ld(out, 13)) < 0 || put_byte(out, 0x0a) < 0
            || put_byte(out, 0x10) < 0 || put_id(out, PyTuple_GET_ITEM(lk, 0), 16) < 0
            || put_byte(out, 0x12) < 0 || put_byte(out, 0x08) < 0
            || put_id(out, PyTuple_GET_ITEM(lk, 1), 8) < 0
            || (t = PyObject_IsTrue(la)) < 0 || (t && attributes(out, 4, la, fallback) < 0)
            || end_ld(out, sub) < 0)
            goto done;
    }
    Py_CLEAR(seq);
    if ((t = PyObject_IsTrue(status_code)) < 0)
        goto done;
    if (t) { /* Status: message 2, code 3 */
        uint64_t code;
        int has_msg;
        if ((sub = begin_ld(out, 15)) < 0 || (has_msg = PyObject_IsTrue(status_message)) < 0
            || (has_msg && put_str(out, 2, status_message) < 0)
            || as_u64(status_code, &code) < 0 || put_byte(out, 0x18) < 0
            || put_varint(out, code) < 0 || end_ld(out, sub) < 0)
            goto done;
    }
    if ((t = PyObject_IsTrue(parent_remote)) < 0 || flags_field(out, flags, t ? 0x200 : 0) < 0
        || end_ld(out, at) < 0)
        goto done;
    /* the children: (name, span_id, start, end, attributes, kind), parent = the root */
    if ((seq = PySequence_Fast(children, "children must be a sequence")) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *c = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 6) {
            PyErr_SetString(PyExc_TypeError, "a child is a 6-tuple");
            goto done;
        }
        PyObject *ca = PyTuple_GET_ITEM(c, 4);
        if ((sub = begin_ld(out, 2)) < 0 || put(out, ids.data, ids.len) < 0
            || put_byte(out, 0x12) < 0 || put_byte(out, 0x08) < 0
            || put_id(out, PyTuple_GET_ITEM(c, 1), 8) < 0
            || put(out, st.data ? st.data : "", st.len) < 0 || put_byte(out, 0x22) < 0
            || put_byte(out, 0x08) < 0 || put_id(out, span_id, 8) < 0
            || name_kind(out, PyTuple_GET_ITEM(c, 0), PyTuple_GET_ITEM(c, 5)) < 0
            || times(out, PyTuple_GET_ITEM(c, 2), PyTuple_GET_ITEM(c, 3), 0) < 0
            || (t = PyObject_IsTrue(ca)) < 0 || (t && attributes(out, 9, ca, fallback) < 0)
            || flags_field(out, flags, 0) < 0 || end_ld(out, sub) < 0)
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(seq);
    buf_free(&ids);
    buf_free(&st);
    return rc;
}

static PyObject *record(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "record(record, any_value)");
        return NULL;
    }
    Buf out = {0};
    if (encode(&out, args[0], args[1]) < 0) {
        buf_free(&out);
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize(out.data ? out.data : "", out.len);
    buf_free(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"record", (PyCFunction)(void (*)(void))record, METH_FASTCALL,
     "record(r, any_value) -> bytes: a to_record tuple as ScopeSpans.spans fields."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlp", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__otlp(void) {
    if (ZERO == NULL && (ZERO = PyLong_FromLong(0)) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
