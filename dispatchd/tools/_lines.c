/* dispatchd.tools._lines: the two per-line loops of read_file and
 * search_files, in C (and the lstat of the path rules' walk, is_symlink;
 * read_file's usual open, read and sniff by descriptor, read_beneath). The
 * tool server's fast lane for read_file is _fastread.c, in this module too.
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
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "_lines.h"

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

/* The number of b'\n' in [p, p + n): eight bytes at a time (a byte equal to
 * '\n' is a zero byte of w ^ 0x0a0a..., found exactly by the high bit of
 * ~(((x & 0x7f..) + 0x7f..) | x | 0x7f..)), about 6x a memchr per line on
 * short lines. */
static Py_ssize_t
count_newlines(const char *p, Py_ssize_t n)
{
    const uint64_t ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL, low = 0x7f7f7f7f7f7f7f7fULL;
    Py_ssize_t count = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        uint64_t x = w ^ (ones * '\n');
        uint64_t zero = ~(((x & low) + low) | x | low) & high;
        count += (Py_ssize_t)((((zero >> 7) * ones) >> 56)); /* the sum of its eight 0/1 bytes */
    }
    for (; i < n; i++)
        count += p[i] == '\n';
    return count;
}

/* Whether [p, p + n) is all ASCII (no byte with its high bit set), eight
 * bytes at a time. */
static int
all_ascii(const char *p, Py_ssize_t n)
{
    uint64_t seen = 0;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        seen |= w;
    }
    for (; i < n; i++)
        seen |= (unsigned char)p[i];
    return (seen & 0x8080808080808080ULL) == 0;
}

/* A line number counted up in decimal, its digits right-aligned in ``d``
 * (zeros to the left): the next number is a carry from the right, where
 * put_number divided by ten for every digit of every line. */
typedef struct {
    char d[24];
    int len;
} Counter;

static void
counter_start(Counter *c, Py_ssize_t v)
{
    char tmp[24];
    char *end = put_number(tmp, v); /* v < 2**62: at most 19 digits */
    memset(c->d, '0', sizeof c->d);
    c->len = (int)(end - tmp);
    memcpy(c->d + sizeof c->d - c->len, tmp, (size_t)c->len);
}

static char *
counter_put(const Counter *c, char *w)
{
    memcpy(w, c->d + sizeof c->d - c->len, (size_t)c->len);
    return w + c->len;
}

static void
counter_next(Counter *c)
{
    int i = (int)sizeof c->d - 1;
    while (c->d[i] == '9') /* stops within d: a number of 19 digits at most, and zeros to its left */
        c->d[i--] = '0';
    c->d[i]++;
    if ((int)sizeof c->d - i > c->len)
        c->len = (int)sizeof c->d - i;
}

/* The last b'\n' in [p, p + n), or NULL. */
static const char *
last_newline(const char *p, Py_ssize_t n)
{
    return n > 0 ? memrchr(p, '\n', (size_t)n) : NULL;
}

/* The first pass of numbering: lines ``start`` to ``end`` (inclusive; -1:
 * the last) of ``data``, split as read_file splits it. Fills ``plan`` and
 * returns 0, or returns 1 when ``start`` is past the end (``plan->total``
 * still set). 0 <= start and -1 <= end (the callers check). */
int
dl_number_plan(const char *data, Py_ssize_t n, Py_ssize_t start, Py_ssize_t end, DlNumbering *plan)
{
    /* One pass: the offsets where lines ``start`` and ``end + 1`` begin,
     * and the number of lines; and where each of the first DL_NEXT_CACHED
     * lines from ``start`` on ends (past its newline), so that the writing
     * loop (dl_number_write) does not search them again (a memchr a line:
     * about 2,000 instructions of a 63-line read). */
    Py_ssize_t total = 0, pos = 0, begin = -1, stop_at = -1;
    /* An end past any line is the last line (and end + 1 must not overflow). */
    Py_ssize_t stop = end == -1 || end >= n ? -1 : end + 1;
    while (pos < n) {
        if (total == start)
            begin = pos;
        if (total == stop)
            stop_at = pos;
        const char *nl = memchr(data + pos, '\n', (size_t)(n - pos));
        pos = nl == NULL ? n : nl - data + 1;
        if (total >= start && total - start < DL_NEXT_CACHED)
            plan->ends[total - start] = pos;
        total++;
    }
    plan->total = total;
    if (total == 0 && start == 0) {  /* an empty file: its one empty view */
        plan->start = plan->stop = plan->begin = plan->span = plan->size = 0;
        return 0;
    }
    if (begin < 0)
        return 1;
    if (stop == -1 || stop > total)
        stop = total;
    if (stop < start)
        stop = start;
    if (stop_at < 0)
        stop_at = n;
    if (stop_at < begin)
        stop_at = begin; /* end before start: no line, an empty span (never a negative size) */
    Py_ssize_t span = stop_at - begin;
    if (span > 0 && data[stop_at - 1] == '\n')
        span--; /* the last line's newline is not shown */
    plan->start = start;
    plan->stop = stop;
    plan->begin = begin;
    plan->span = span;
    plan->size = span + digits_in_range(start, stop) + 2 * (stop - start);
    return 0;
}

/* Whether the bytes the plan shows are all ASCII (then the text is those
 * bytes with their labels, as its decode would give them). */
int
dl_number_ascii(const char *data, const DlNumbering *plan)
{
    return all_ascii(data + plan->begin, plan->span);
}

/* The text the plan describes, exactly plan->size bytes, written at ``w``
 * (each line "N: " and its bytes, the last without its newline); returns
 * the end. */
char *
dl_number_write(const char *data, const DlNumbering *plan, char *w)
{
    Py_ssize_t start = plan->start, stop = plan->stop, total = plan->total;
    Py_ssize_t at = plan->begin, limit = plan->begin + plan->span;
    Counter number;
    counter_start(&number, start);
    for (Py_ssize_t i = start; i < stop; i++) {
        w = counter_put(&number, w);
        counter_next(&number);
        *w++ = ':';
        *w++ = ' ';
        Py_ssize_t next;
        if (i - start < DL_NEXT_CACHED && i < total) {
            /* The first newline from ``at`` in the whole text, as the
             * first pass found it; within ``limit`` it is the one a
             * search of [at, limit) finds, past it there is none there. */
            next = plan->ends[i - start] < limit ? plan->ends[i - start] : limit;
        } else {
            const char *nl = at < limit ? memchr(data + at, '\n', (size_t)(limit - at)) : NULL;
            next = nl == NULL ? limit : nl - data + 1;
        }
        memcpy(w, data + at, (size_t)(next - at));
        w += next - at;
        at = next;
    }
    return w;
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
    if (start < 0 || end < -1) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "start must be >= 0 and end >= -1");
        return NULL;
    }
    DlNumbering plan;
    PyObject *text = NULL;
    if (dl_number_plan(data, view.len, start, end, &plan) != 0) {
        text = Py_NewRef(Py_None);
    } else if (dl_number_ascii(data, &plan)) {
        /* ASCII lines (the usual source file) are written straight into the
         * str, as its decode would give them: no buffer and no decode (the
         * decode cost more than the test). */
        text = PyUnicode_New(plan.size, 127);
        if (text != NULL) {
            char *buf = (char *)PyUnicode_1BYTE_DATA(text);
            if (dl_number_write(data, &plan, buf) - buf != plan.size) { /* never: size counts what it writes */
                Py_CLEAR(text);
                PyErr_SetString(PyExc_SystemError, "numbered: the text's size was miscounted");
            }
        }
    } else {
        char *buf = PyMem_Malloc(plan.size > 0 ? (size_t)plan.size : 1);
        if (buf == NULL) {
            PyErr_NoMemory();
        } else {
            char *w = dl_number_write(data, &plan, buf);
            text = PyUnicode_DecodeUTF8(buf, w - buf, "replace");
            PyMem_Free(buf);
        }
    }
    Py_ssize_t total = plan.total;
    PyBuffer_Release(&view);
    if (text == NULL)
        return NULL;
    return Py_BuildValue("(Nn)", text, total);
}

typedef struct {
    Py_ssize_t line, begin, end; /* end: where the shown text ends (no CR, no LF) */
} Hit;

/* How a literal is found: by the needle's byte at ``at`` (one search_files
 * learnt is rare in the tree) with memchr, each candidate compared, until
 * more than ``budget`` candidates have missed; then, or with ``at`` -1, by
 * glibc's memmem (1.3-2.5 GB/s here, where memchr runs several times that). */
typedef struct {
    const char *needle;
    Py_ssize_t m, at, budget, misses;
} Finder;

/* Where the needle next starts in data[pos:n], or -1. */
static Py_ssize_t
find(Finder *f, const char *data, Py_ssize_t n, Py_ssize_t pos)
{
    if (f->at >= 0) {
        unsigned char rare = (unsigned char)f->needle[f->at];
        Py_ssize_t p = pos + f->at;
        while (p < n) {
            const char *c = memchr(data + p, rare, (size_t)(n - p));
            if (c == NULL)
                return -1;
            Py_ssize_t start = c - data - f->at; /* >= pos: p >= pos + at */
            if (start + f->m <= n && memcmp(data + start, f->needle, (size_t)f->m) == 0)
                return start;
            if (++f->misses > f->budget) {
                /* More common than learnt: memmem from here on. Every
                 * occurrence from ``pos`` has the rare byte at ``at``, and
                 * every one that starts before ``start`` was tried. */
                f->at = -1;
                pos = start;
                break;
            }
            p = c - data + 1;
        }
        if (f->at >= 0)
            return -1;
    }
    const char *h = memmem(data + pos, (size_t)(n - pos), f->needle, (size_t)f->m);
    return h == NULL ? -1 : h - data;
}

/* search_literal(data, needle, room, name, max_bytes, at=-1, budget=0)
 *     -> (text | None, count, more, misses)
 *
 * The first ``room`` lines of ``data`` holding ``needle`` (no b'\n' in it),
 * each shown as ``name + ":N: " + line`` (N 0-based, the line without its
 * newline and one CR before it), joined with "\n" and decoded as UTF-8 with
 * U+FFFD for invalid sequences; ``count`` how many; ``more`` whether a further
 * line holds it. ``text`` is None (and ``count`` -1) when a line to show is
 * longer than ``max_bytes`` (search_files cuts such a line by characters:
 * its Python path does that) or ``name`` is not encodable. ``at`` and
 * ``budget`` say how to find (Finder); ``misses`` is how many of the rare
 * byte's candidates missed (more than ``budget``: it gave up on it). */
static PyObject *
search_literal(PyObject *self, PyObject *args)
{
    Py_buffer view, nview;
    Py_ssize_t room, max_bytes, at = -1, budget = 0;
    PyObject *name;
    if (!PyArg_ParseTuple(args, "y*y*nUn|nn:search_literal", &view, &nview, &room, &name, &max_bytes, &at,
                          &budget))
        return NULL;
    const char *data = view.buf, *needle = nview.buf;
    Py_ssize_t n = view.len, m = nview.len;
    PyObject *result = NULL;
    Hit *hits = NULL;
    Py_ssize_t count = 0, cap = 0;
    int too_long = 0, no_memory = 0, more = 0;
    if (m == 0 || memchr(needle, '\n', (size_t)m) != NULL || room < 0 || at < -1 || at >= m) {
        PyErr_SetString(PyExc_ValueError,
                        "needle must be non-empty, without a newline; room >= 0; -1 <= at < len(needle)");
        goto done;
    }
    Finder finder = {needle, m, at, budget, 0};
    Py_BEGIN_ALLOW_THREADS
    /* ``pos`` is always where a line begins; ``counted`` the offset up to
     * which newlines are counted into ``line``. */
    Py_ssize_t pos = 0, counted = 0, line = 0;
    while (pos < n) {
        Py_ssize_t hit = find(&finder, data, n, pos);
        if (hit < 0)
            break;
        if (count == room) {
            more = 1;
            break;
        }
        const char *prev = last_newline(data + pos, hit - pos);
        Py_ssize_t begin = prev == NULL ? pos : prev - data + 1;
        line += count_newlines(data + counted, begin - counted);
        counted = begin;
        const char *nl = memchr(data + hit, '\n', (size_t)(n - hit));
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
        result = Py_BuildValue("(OnOn)", Py_None, (Py_ssize_t)-1, Py_False, finder.misses);
        goto done;
    }
    if (count == 0) {
        result = Py_BuildValue("(snOn)", "", (Py_ssize_t)0, more ? Py_True : Py_False, finder.misses);
        goto done;
    }
    Py_ssize_t name_len;
    const char *name_utf8 = PyUnicode_AsUTF8AndSize(name, &name_len);
    if (name_utf8 == NULL) { /* a lone surrogate: the Python path words it */
        PyErr_Clear();
        result = Py_BuildValue("(OnOn)", Py_None, (Py_ssize_t)-1, Py_False, finder.misses);
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
        result = Py_BuildValue("(NnOn)", text, count, more ? Py_True : Py_False, finder.misses);
done:
    free(hits);
    PyBuffer_Release(&view);
    PyBuffer_Release(&nview);
    return result;
}

/* The bytes of the open file ``fd`` (closed here, always) when it is a
 * regular file of at most ``cap`` bytes, read whole in one read of its size
 * and one byte more, without a NUL in its first ``sniff`` bytes; None when
 * it is not; False when the read did not give the size fstat gave. */
PyObject *
dl_read_whole(int fd, Py_ssize_t cap, Py_ssize_t sniff)
{
    struct stat st;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = fstat(fd, &st) == 0;
    Py_END_ALLOW_THREADS
    if (!ok || !S_ISREG(st.st_mode) || st.st_size > cap || st.st_size < 0 || st.st_size >= PY_SSIZE_T_MAX) {
        close(fd);
        Py_RETURN_NONE;
    }
    Py_ssize_t size = (Py_ssize_t)st.st_size;
    PyObject *data = PyBytes_FromStringAndSize(NULL, size + 1);
    if (data == NULL) {
        close(fd);
        return NULL;
    }
    char *buf = PyBytes_AS_STRING(data);
    ssize_t got;
    Py_BEGIN_ALLOW_THREADS
    do {
        got = read(fd, buf, (size_t)size + 1);
    } while (got < 0 && errno == EINTR);
    close(fd);
    Py_END_ALLOW_THREADS
    if (got < 0) {
        Py_DECREF(data);
        Py_RETURN_NONE;
    }
    if (got != size) {
        Py_DECREF(data);
        Py_RETURN_FALSE;
    }
    if (memchr(buf, 0, (size_t)(size < sniff ? size : sniff)) != NULL) {
        Py_DECREF(data);
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&data, size) < 0)
        return NULL;
    return data;
}

/* read_text(path, cap, sniff) -> bytes | None | False
 *
 * search_files' read of one file: opened without blocking and without
 * following a symlink at the last component, then dl_read_whole: its bytes if
 * it is a regular text file within ``cap``; None when it is not (unreadable,
 * not regular, over the cap, binary); False when it changed while read (the
 * caller reads it again, in Python, with read_regular's loop). The file
 * system calls run without the GIL. */
static PyObject *
read_text(PyObject *self, PyObject *args)
{
    PyObject *encoded;
    Py_ssize_t cap, sniff;
    if (!PyArg_ParseTuple(args, "O&nn:read_text", PyUnicode_FSConverter, &encoded, &cap, &sniff))
        return NULL;
    if (cap < 0 || sniff < 0) {
        Py_DECREF(encoded);
        PyErr_SetString(PyExc_ValueError, "cap and sniff must be >= 0");
        return NULL;
    }
    const char *path = PyBytes_AS_STRING(encoded);
    int fd;
    Py_BEGIN_ALLOW_THREADS
    do {
        fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    Py_END_ALLOW_THREADS
    Py_DECREF(encoded);
    if (fd < 0)
        Py_RETURN_NONE;
    return dl_read_whole(fd, cap, sniff);
}

/* Whether ``path`` (``len`` bytes, no NUL) is a plain relative path: not
 * empty, not absolute, and every '/'-separated component neither empty nor
 * "." nor "..". Such a path is its own display form, and only it takes
 * read_beneath's one call. */
static int
plain_relative(const char *path, Py_ssize_t len)
{
    if (len == 0 || path[0] == '/')
        return 0;
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 0; i <= len; i++) {
        if (i == len || path[i] == '/') {
            Py_ssize_t n = i - start;
            if (n == 0 || (n == 1 && path[start] == '.') || (n == 2 && path[start] == '.' && path[start + 1] == '.'))
                return 0;
            start = i + 1;
        }
    }
    return 1;
}

/* ``raw`` (``len`` bytes, NUL-terminated), a plain relative path opened
 * below the directory ``root_fd`` by openat2 with RESOLVE_BENEATH,
 * RESOLVE_NO_SYMLINKS and RESOLVE_NO_MAGICLINKS, without blocking and
 * close-on-exec: the descriptor, or -1 for anything else (``root_fd`` < 0,
 * a NUL inside, a path not plain, a symlink on the way, missing,
 * unreadable; EAGAIN, a rename racing the walk, is not retried). Runs
 * without the GIL; the caller holds it. */
int
dl_open_beneath(int root_fd, const char *raw, Py_ssize_t len)
{
    if (root_fd < 0 || (Py_ssize_t)strlen(raw) != len || !plain_relative(raw, len))  /* < 0: never AT_FDCWD */
        return -1;
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    long fd;
    Py_BEGIN_ALLOW_THREADS
    do {
        fd = syscall(SYS_openat2, root_fd, raw, &how, sizeof how);
    } while (fd < 0 && errno == EINTR);
    Py_END_ALLOW_THREADS
    return fd < 0 ? -1 : (int)fd;
}

/* read_beneath(root_fd, path, cap, sniff) -> bytes | None
 *
 * read_file's usual call in one open by descriptor: ``path``, a plain
 * relative path (plain_relative), opened below the directory ``root_fd``
 * with openat2's RESOLVE_BENEATH and RESOLVE_NO_SYMLINKS (the kernel refuses
 * any symlink on the way, a magic link and any escape from the root, in the
 * same walk that opens the file: nothing to check before, nothing that can
 * change between a check and the open), then dl_read_whole. None for anything
 * else: a path that is not plain, a symlink on the way, a file missing,
 * unreadable, not regular, over the cap, binary or changing; the caller's
 * full path (the path rules' walk and their messages) then decides, so this
 * function never has to word an error. Never raises for the path's content. */
static PyObject *
read_beneath(PyObject *self, PyObject *args)
{
    int root_fd;
    PyObject *path;
    Py_ssize_t cap, sniff;
    if (!PyArg_ParseTuple(args, "iUnn:read_beneath", &root_fd, &path, &cap, &sniff))
        return NULL;
    if (cap < 0 || sniff < 0) {
        PyErr_SetString(PyExc_ValueError, "cap and sniff must be >= 0");
        return NULL;
    }
    PyObject *encoded = PyUnicode_EncodeFSDefault(path);  /* surrogateescape, as os.open's */
    if (encoded == NULL) {
        PyErr_Clear();  /* a lone surrogate that no file name holds: the full path says so */
        Py_RETURN_NONE;
    }
    const char *raw = PyBytes_AS_STRING(encoded);
    Py_ssize_t len = PyBytes_GET_SIZE(encoded);
    int fd = dl_open_beneath(root_fd, raw, len);
    Py_DECREF(encoded);
    if (fd < 0)
        Py_RETURN_NONE;
    PyObject *data = dl_read_whole(fd, cap, sniff);
    if (data == Py_False) {
        Py_DECREF(data);
        Py_RETURN_NONE;
    }
    return data;
}

/* is_symlink(path) -> bool
 *
 * Whether ``path`` itself is a symbolic link: os.lstat(path).st_mode tested
 * with S_ISLNK, without the stat_result os.lstat builds (about 4,500
 * instructions, on every component of every read_file's path). An error
 * raises what os.lstat raises: the OSError subclass of its errno, with
 * ``path`` as its filename. The system call runs without the GIL. */
static PyObject *
is_symlink(PyObject *self, PyObject *path)
{
    PyObject *encoded;
    if (!PyUnicode_FSConverter(path, &encoded))
        return NULL;
    struct stat st;
    int failed, err = 0;
    Py_BEGIN_ALLOW_THREADS
    failed = lstat(PyBytes_AS_STRING(encoded), &st) != 0;
    if (failed)
        err = errno;
    Py_END_ALLOW_THREADS
    Py_DECREF(encoded);
    if (failed) {
        errno = err;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    }
    return PyBool_FromLong(S_ISLNK(st.st_mode));
}

static PyMethodDef methods[] = {
    {"is_symlink", is_symlink, METH_O, "read_file's path walk: whether lstat(path) is a symbolic link."},
    {"numbered", numbered, METH_VARARGS, "read_file's numbered lines: (text | None, total)."},
    {"search_literal", search_literal, METH_VARARGS,
     "search_files' lines holding a literal, labelled: (text | None, count, more, misses)."},
    {"read_text", read_text, METH_VARARGS, "search_files' read of one text file: bytes | None | False."},
    {"read_beneath", read_beneath, METH_VARARGS,
     "read_file's usual read: a plain relative path opened below a directory fd by openat2: bytes | None."},
    {"serve_read", dl_serve_read, METH_VARARGS,
     "The tool server's fast lane: one request read, answered when it is the usual read_file call (_fastread.c)."},
    {"lane_calls", dl_lane_calls, METH_NOARGS, "How many calls the fast lane is answering now (_fastread.c)."},
    {"spawn_subreaper", dl_spawn_subreaper, METH_VARARGS,
     "Start a command, a child subreaper in its own session, by vfork and exec (_spawn.c): its pid."},
    {"spawn_confined", dl_spawn_confined, METH_VARARGS,
     "Start a program by vfork and exec, confined in the child before its exec (_confined.c): its pid."},
    {"subdir_ctimes", dl_subdir_ctimes, METH_VARARGS,
     "The ctime of each subdirectory of a directory fd, by name, those of so many hex digits or named (_ctimes.c)."},
    {"recent_named", dl_recent_named, METH_VARARGS,
     "The kept object files whose repository file changed since a time (_ctimes.c)."},
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
