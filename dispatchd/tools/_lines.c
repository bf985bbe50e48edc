/* dispatchd.tools._lines: the two per-line loops of read_file and
 * search_files, in C.
 *
 * What it guarantees: each function returns exactly the text the pure-Python
 * path returns for the same bytes (tests/unit/test_native_lines.py compares
 * the two over a corpus and random bytes), or says that it cannot
 * (search_literal's None), and the Python path then runs.
 *
 * Why C: CPython spends about 1 µs a line on these loops (a bytes object, a
 * label, a decode and a join per line), which keeps search_files with tens of
 * thousands of matching lines at 2.5x ripgrep and read_file's numbering at
 * 40% of the tool server's instructions a call. Here a line costs a memchr
 * and a copy, and the whole text is decoded once.
 *
 * Safety: every offset is checked against the buffer's length before use;
 * sizes are computed before writing and checked for overflow. The functions
 * run inside the sandbox, in the tool server, on the worktree's (hostile)
 * bytes: a fault here is a fault of a confined process that already runs the
 * agent's own commands, never of the daemon.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


/* Number of decimal digits of v >= 0. */
static Py_ssize_t
digits(Py_ssize_t v)
{
    Py_ssize_t d = 1;
    while (v >= 10) {
        v /= 10;
        d++;
    }
    return d;
}

/* Write v >= 0 in decimal at p; return the end. */
static char *
put_number(char *p, Py_ssize_t v)
{
    char tmp[24];
    int i = 0;
    do {
        tmp[i++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (i)
        *p++ = tmp[--i];
    return p;
}

/* The sum of digits(i) for start <= i < stop (0 <= start <= stop). */
static Py_ssize_t
digits_in_range(Py_ssize_t start, Py_ssize_t stop)
{
    Py_ssize_t total = 0, low = 0, high = 10, d = 1;
    while (low < stop) {
        Py_ssize_t a = start > low ? start : low;
        Py_ssize_t b = stop < high ? stop : high;
        if (b > a)
            total += (b - a) * d;
        if (high > PY_SSIZE_T_MAX / 10)
            break;
        low = high;
        high *= 10;
        d++;
    }
    return total;
}

/* The last b'\n' in [p, p + n), or NULL. */
static const char *
last_newline(const char *p, Py_ssize_t n)
{
    return n > 0 ? memrchr(p, '\n', (size_t)n) : NULL;
}

/* numbered(data, start, end) -> (text | None, total)
 *
 * ``data`` split into lines as read_file splits it (after each b'\n'; a file
 * that ends with one has no empty line after it), ``total`` the number of
 * lines, and ``text`` lines ``start`` to ``end`` (inclusive; -1: the last),
 * each prefixed with "N: ", the last without its newline, decoded as UTF-8
 * with U+FFFD for invalid sequences. ``text`` is None when ``start`` is past
 * the end (read_file words that). */
static PyObject *
numbered(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "y*nn:numbered", &view, &start, &end))
        return NULL;
    const char *data = view.buf;
    Py_ssize_t n = view.len;
    if (start < 0 || end < -1) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "start must be >= 0 and end >= -1");
        return NULL;
    }
    /* One pass: the offsets where lines ``start`` and ``end + 1`` begin,
     * and the number of lines. */
    Py_ssize_t total = 0, pos = 0, begin = -1, stop_at = -1;
    /* An end past any line is the last line (and end + 1 must not overflow). */
    Py_ssize_t stop = end == -1 || end >= n ? -1 : end + 1;
    while (pos < n) {
        if (total == start)
            begin = pos;
        if (total == stop)
            stop_at = pos;
        const char *nl = memchr(data + pos, '\n', (size_t)(n - pos));
        total++;
        if (nl == NULL) {
            pos = n;
            break;
        }
        pos = nl - data + 1;
    }
    PyObject *text;
    if (total == 0 && start == 0) {
        text = PyUnicode_FromStringAndSize("", 0);
    } else if (begin < 0) {
        text = Py_NewRef(Py_None);
    } else {
        if (stop == -1 || stop > total)
            stop = total;
        if (stop < start)
            stop = start;
        if (stop_at < 0)
            stop_at = n;
        Py_ssize_t span = stop_at - begin;
        if (span > 0 && data[stop_at - 1] == '\n')
            span--; /* the last line's newline is not shown */
        Py_ssize_t lines = stop - start;
        Py_ssize_t size = span + digits_in_range(start, stop) + 2 * lines;
        char *buf = PyMem_Malloc(size > 0 ? (size_t)size : 1);
        if (buf == NULL) {
            PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
        char *w = buf;
        Py_ssize_t at = begin, limit = begin + span;
        for (Py_ssize_t i = start; i < stop; i++) {
            w = put_number(w, i);
            *w++ = ':';
            *w++ = ' ';
            const char *nl = at < limit ? memchr(data + at, '\n', (size_t)(limit - at)) : NULL;
            Py_ssize_t next = nl == NULL ? limit : nl - data + 1;
            memcpy(w, data + at, (size_t)(next - at));
            w += next - at;
            at = next;
        }
        text = PyUnicode_DecodeUTF8(buf, w - buf, "replace");
        PyMem_Free(buf);
    }
    PyBuffer_Release(&view);
    if (text == NULL)
        return NULL;
    return Py_BuildValue("(Nn)", text, total);
}

typedef struct {
    Py_ssize_t line, begin, end; /* end: where the shown text ends (no CR, no LF) */
} Hit;

/* search_literal(data, needle, room, name, max_bytes) -> (text | None, count, more)
 *
 * The first ``room`` lines of ``data`` holding ``needle`` (no b'\n' in it),
 * each shown as ``name + ":N: " + line`` (N 0-based, the line without its
 * newline and one CR before it), joined with "\n" and decoded as UTF-8 with
 * U+FFFD for invalid sequences; ``count`` how many; ``more`` whether a further
 * line holds it. ``text`` is None (and ``count`` -1) when a line to show is
 * longer than ``max_bytes`` (search_files cuts such a line by characters:
 * its Python path does that) or ``name`` is not encodable. */
static PyObject *
search_literal(PyObject *self, PyObject *args)
{
    Py_buffer view, nview;
    Py_ssize_t room, max_bytes;
    PyObject *name;
    if (!PyArg_ParseTuple(args, "y*y*nUn:search_literal", &view, &nview, &room, &name, &max_bytes))
        return NULL;
    const char *data = view.buf, *needle = nview.buf;
    Py_ssize_t n = view.len, m = nview.len;
    PyObject *result = NULL;
    Hit *hits = NULL;
    Py_ssize_t count = 0, cap = 0;
    int too_long = 0, no_memory = 0, more = 0;
    if (m == 0 || memchr(needle, '\n', (size_t)m) != NULL || room < 0) {
        PyErr_SetString(PyExc_ValueError, "needle must be non-empty, without a newline; room >= 0");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    /* ``pos`` is always where a line begins; ``counted`` the offset up to
     * which newlines are counted into ``line``. */
    Py_ssize_t pos = 0, counted = 0, line = 0;
    while (pos < n) {
        const char *at = memmem(data + pos, (size_t)(n - pos), needle, (size_t)m);
        if (at == NULL)
            break;
        if (count == room) {
            more = 1;
            break;
        }
        Py_ssize_t hit = at - data;
        const char *prev = last_newline(data + pos, hit - pos);
        Py_ssize_t begin = prev == NULL ? pos : prev - data + 1;
        while (counted < begin) {
            const char *nl = memchr(data + counted, '\n', (size_t)(begin - counted));
            if (nl == NULL)
                break;
            line++;
            counted = nl - data + 1;
        }
        counted = begin;
        const char *nl = memchr(at, '\n', (size_t)(n - hit));
        Py_ssize_t stop = nl == NULL ? n : nl - data;
        Py_ssize_t shown = stop;
        if (shown > begin && data[shown - 1] == '\r')
            shown--;
        if (shown - begin > max_bytes) {
            too_long = 1;
            break;
        }
        if (count == cap) {
            Py_ssize_t grown = cap ? cap * 2 : 64;
            Hit *more = realloc(hits, (size_t)grown * sizeof(Hit));
            if (more == NULL) {
                no_memory = 1;
                break;
            }
            hits = more;
            cap = grown;
        }
        hits[count].line = line;
        hits[count].begin = begin;
        hits[count].end = shown;
        count++;
        pos = stop + 1;
    }
    Py_END_ALLOW_THREADS
    if (no_memory) {
        PyErr_NoMemory();
        goto done;
    }
    if (too_long) {
        result = Py_BuildValue("(OnO)", Py_None, (Py_ssize_t)-1, Py_False);
        goto done;
    }
    if (count == 0) {
        result = Py_BuildValue("(snO)", "", (Py_ssize_t)0, more ? Py_True : Py_False);
        goto done;
    }
    Py_ssize_t name_len;
    const char *name_utf8 = PyUnicode_AsUTF8AndSize(name, &name_len);
    if (name_utf8 == NULL) { /* a lone surrogate: the Python path words it */
        PyErr_Clear();
        result = Py_BuildValue("(OnO)", Py_None, (Py_ssize_t)-1, Py_False);
        goto done;
    }
    /* name ":" N ": " text, joined with "\n": every term is bounded by n or
     * by the count, so the sum fits (count <= n, name_len is a path). */
    Py_ssize_t size = count - 1;
    for (Py_ssize_t i = 0; i < count; i++)
        size += name_len + 3 + digits(hits[i].line) + (hits[i].end - hits[i].begin);
    char *buf = PyMem_Malloc((size_t)size);
    if (buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    char *w = buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i)
            *w++ = '\n';
        memcpy(w, name_utf8, (size_t)name_len);
        w += name_len;
        *w++ = ':';
        w = put_number(w, hits[i].line);
        *w++ = ':';
        *w++ = ' ';
        memcpy(w, data + hits[i].begin, (size_t)(hits[i].end - hits[i].begin));
        w += hits[i].end - hits[i].begin;
    }
    PyObject *text = PyUnicode_DecodeUTF8(buf, w - buf, "replace");
    PyMem_Free(buf);
    if (text != NULL)
        result = Py_BuildValue("(NnO)", text, count, more ? Py_True : Py_False);
done:
    free(hits);
    PyBuffer_Release(&view);
    PyBuffer_Release(&nview);
    return result;
}

static PyMethodDef methods[] = {
    {"numbered", numbered, METH_VARARGS, "read_file's numbered lines: (text | None, total)."},
    {"search_literal", search_literal, METH_VARARGS,
     "search_files' lines holding a literal, labelled: (text | None, count, more)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dispatchd.tools._lines",
    "read_file's and search_files' per-line loops in C (see _lines.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__lines(void)
{
    return PyModule_Create(&module);
}
