/* The tool server's fast lane for read_file: one request read from a
 * client channel and, when it is the usual read_file call, answered here
 * without a Python object for the request, its arguments, its result or
 * its reply (dispatchd/worker/channel.py, ``Channel.run``).
 *
 * What it guarantees: a request it answers gets the reply frame the Python
 * path would send, byte for byte (tests/unit/test_fastread.py compares the
 * two over generated requests and files); anything else it hands back
 * untouched (the bytes that came, for the Python path to read as if it had
 * received them itself). It never words an error: a request that is not a
 * plain call, a path that is not plain, a file missing, binary, over the
 * cap or past its end, a reply over the frame limit, the server draining:
 * all go back to Python, whose messages and checks decide.
 *
 * The usual call is one whole frame (one recv brings one, or several sent
 * at once by threads sharing a session: each at the front is taken in
 * turn): a msgpack map of "op": "call_tool", "id", "tool": "read_file",
 * "params" (a map of "path", printable ASCII, and at most "start_line" and
 * "end_line", in range) and "stream". Anything the decoder would read
 * otherwise (another key, a duplicate, another type or encoding, trailing
 * bytes) is not it, and neither is any frame after one that is not.
 *
 * Why: with eight clients on two CPUs, the tool server's Python spent about
 * 30 us of CPU a call (decode, check, the tool's frame, the Outcome, the
 * reply's encode, each a few thousand instructions, and their caches
 * evicted by the other fifteen processes between calls); here a call is
 * its six system calls and a few thousand instructions of C.
 *
 * Safety: the request is read with every length checked against what is
 * left before any byte is touched; the path is copied into a buffer of
 * PATH_MAX only when shorter; the reply's size is computed before it is
 * written. The function runs in the sandboxed tool server, on the client's
 * bytes (the agent's arguments): a fault here stays in the sandbox, never
 * the daemon's, but would hand the tool server's channels to the attacker;
 * hence the one narrow shape taken, and the sanitizer and differential
 * tests (SECURITY.md, "Filesystem").
 */
#include "_lines.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* -- reading the request ---------------------------------------------------- */

typedef struct {
    const unsigned char *p, *end;
} Reader;

static int
take(Reader *r, Py_ssize_t n, const unsigned char **at)
{
    if (n < 0 || r->end - r->p < n)
        return 0;
    *at = r->p;
    r->p += n;
    return 1;
}

static uint64_t
big_endian(const unsigned char *b, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | b[i];
    return v;
}

/* A map header: its number of pairs (fixmap and map16 only). */
static int
read_map(Reader *r, Py_ssize_t *pairs)
{
    const unsigned char *b;
    if (!take(r, 1, &b))
        return 0;
    if ((*b & 0xf0) == 0x80) {
        *pairs = *b & 0x0f;
        return 1;
    }
    if (*b == 0xde && take(r, 2, &b)) {
        *pairs = (Py_ssize_t)big_endian(b, 2);
        return 1;
    }
    return 0;
}

/* A str: where its bytes start and how many (fixstr, str8, str16, str32). */
static int
read_str(Reader *r, const unsigned char **s, Py_ssize_t *n)
{
    const unsigned char *b;
    if (!take(r, 1, &b))
        return 0;
    int width = 0;
    if ((*b & 0xe0) == 0xa0)
        *n = *b & 0x1f;
    else if (*b == 0xd9)
        width = 1;
    else if (*b == 0xda)
        width = 2;
    else if (*b == 0xdb)
        width = 4;
    else
        return 0;
    if (width) {
        if (!take(r, width, &b))
            return 0;
        *n = (Py_ssize_t)big_endian(b, width);
    }
    return take(r, *n, s);
}

/* An int that fits an int64_t, in any of msgpack's int encodings. */
static int
read_int(Reader *r, int64_t *v)
{
    const unsigned char *b;
    if (!take(r, 1, &b))
        return 0;
    unsigned char t = *b;
    if (t <= 0x7f) {
        *v = t;
        return 1;
    }
    if (t >= 0xe0) {
        *v = (int64_t)t - 256;
        return 1;
    }
    int width;
    int is_signed = t >= 0xd0 && t <= 0xd3;
    if (t >= 0xcc && t <= 0xcf)
        width = 1 << (t - 0xcc);
    else if (is_signed)
        width = 1 << (t - 0xd0);
    else
        return 0;
    if (!take(r, width, &b))
        return 0;
    uint64_t u = big_endian(b, width);
    if (!is_signed) {
        if (u > INT64_MAX)
            return 0;
        *v = (int64_t)u;
    } else {
        int shift = 64 - 8 * width; /* sign-extend from the encoding's width */
        *v = (int64_t)(u << shift) >> shift;
    }
    return 1;
}

static int
str_is(const unsigned char *s, Py_ssize_t n, const char *what)
{
    return (size_t)n == strlen(what) && memcmp(s, what, (size_t)n) == 0;
}

typedef struct {
    int64_t id, start, end;
    char path[PATH_MAX];
    Py_ssize_t path_len;
} Call;

/* The params map: "path" (printable ASCII, shorter than PATH_MAX), and
 * "start_line" and "end_line" at most, each once. */
static int
read_params(Reader *r, Call *call)
{
    Py_ssize_t pairs;
    int seen_path = 0, seen_start = 0, seen_end = 0;
    if (!read_map(r, &pairs))
        return 0;
    for (Py_ssize_t i = 0; i < pairs; i++) {
        const unsigned char *key;
        Py_ssize_t n;
        if (!read_str(r, &key, &n))
            return 0;
        if (str_is(key, n, "path") && !seen_path++) {
            const unsigned char *s;
            Py_ssize_t len;
            if (!read_str(r, &s, &len) || len >= PATH_MAX)
                return 0;
            for (Py_ssize_t j = 0; j < len; j++)
                if (s[j] < 0x20 || s[j] > 0x7e)
                    return 0;
            memcpy(call->path, s, (size_t)len);
            call->path[len] = '\0';
            call->path_len = len;
        } else if (str_is(key, n, "start_line") && !seen_start++) {
            if (!read_int(r, &call->start))
                return 0;
        } else if (str_is(key, n, "end_line") && !seen_end++) {
            if (!read_int(r, &call->end))
                return 0;
        } else {
            return 0;
        }
    }
    return seen_path;
}

/* Whether ``payload`` is the usual read_file call; fills ``call``. */
static int
read_call(const unsigned char *payload, Py_ssize_t n, Call *call)
{
    Reader r = {payload, payload + n};
    Py_ssize_t pairs;
    int seen_op = 0, seen_id = 0, seen_tool = 0, seen_params = 0, seen_stream = 0;
    call->start = 0;
    call->end = -1;
    if (!read_map(&r, &pairs))
        return 0;
    for (Py_ssize_t i = 0; i < pairs; i++) {
        const unsigned char *key, *s, *b;
        Py_ssize_t len, vlen;
        if (!read_str(&r, &key, &len))
            return 0;
        if (str_is(key, len, "op") && !seen_op++) {
            if (!read_str(&r, &s, &vlen) || !str_is(s, vlen, "call_tool"))
                return 0;
        } else if (str_is(key, len, "id") && !seen_id++) {
            if (!read_int(&r, &call->id))
                return 0;
        } else if (str_is(key, len, "tool") && !seen_tool++) {
            if (!read_str(&r, &s, &vlen) || !str_is(s, vlen, "read_file"))
                return 0;
        } else if (str_is(key, len, "params") && !seen_params++) {
            if (!read_params(&r, call))
                return 0;
        } else if (str_is(key, len, "stream") && !seen_stream++) {
            /* a fast tool has no output to stream: either way, as the Python path */
            if (!take(&r, 1, &b) || (*b != 0xc2 && *b != 0xc3))
                return 0;
        } else {
            return 0;
        }
    }
    /* read_file's own refusals (and numbers past what numbered takes) are the Python path's to word */
    const int64_t far = (int64_t)1 << 62;
    if (r.p != r.end || !seen_op || !seen_id || !seen_tool || !seen_params)
        return 0;
    if (call->start < 0 || call->start >= far || call->end < -1 || call->end >= far)
        return 0;
    return call->end == -1 || call->start <= call->end;
}

/* -- writing the reply ------------------------------------------------------ */

/* Bytes msgpack needs for ``v``, as msgspec encodes an int: the smallest form. */
static Py_ssize_t
int_size(int64_t v)
{
    if (v >= 0)
        return v < 0x80 ? 1 : v < 0x100 ? 2 : v < 0x10000 ? 3 : v <= 0xffffffffLL ? 5 : 9;
    return v >= -32 ? 1 : v >= -128 ? 2 : v >= -32768 ? 3 : v >= -2147483648LL ? 5 : 9;
}

static unsigned char *
put_be(unsigned char *w, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--)
        w[n - 1 - i] = (unsigned char)(v >> (8 * i));
    return w + n;
}

static unsigned char *
put_int(unsigned char *w, int64_t v)
{
    if (v >= 0) {
        if (v < 0x80) {
            *w++ = (unsigned char)v;
            return w;
        }
        if (v < 0x100) {
            *w++ = 0xcc;
            return put_be(w, (uint64_t)v, 1);
        }
        if (v < 0x10000) {
            *w++ = 0xcd;
            return put_be(w, (uint64_t)v, 2);
        }
        if (v <= 0xffffffffLL) {
            *w++ = 0xce;
            return put_be(w, (uint64_t)v, 4);
        }
        *w++ = 0xcf;
        return put_be(w, (uint64_t)v, 8);
    }
    if (v >= -32) {
        *w++ = (unsigned char)(v & 0xff);
        return w;
    }
    if (v >= -128) {
        *w++ = 0xd0;
        return put_be(w, (uint64_t)v & 0xff, 1);
    }
    if (v >= -32768) {
        *w++ = 0xd1;
        return put_be(w, (uint64_t)v & 0xffff, 2);
    }
    if (v >= -2147483648LL) {
        *w++ = 0xd2;
        return put_be(w, (uint64_t)v & 0xffffffffULL, 4);
    }
    *w++ = 0xd3;
    return put_be(w, (uint64_t)v, 8);
}

static Py_ssize_t
str_header_size(Py_ssize_t n)
{
    return n < 32 ? 1 : n < 0x100 ? 2 : n < 0x10000 ? 3 : 5;
}

static unsigned char *
put_str_header(unsigned char *w, Py_ssize_t n)
{
    if (n < 32) {
        *w++ = (unsigned char)(0xa0 | n);
        return w;
    }
    if (n < 0x100) {
        *w++ = 0xd9;
        return put_be(w, (uint64_t)n, 1);
    }
    if (n < 0x10000) {
        *w++ = 0xda;
        return put_be(w, (uint64_t)n, 2);
    }
    *w++ = 0xdb;
    return put_be(w, (uint64_t)n, 4);
}

static unsigned char *
put_raw(unsigned char *w, const char *s)
{
    size_t n = strlen(s);
    memcpy(w, s, n);
    return w + n;
}

/* The reply's parts around the output, as msgspec writes a ToolReply: its
 * fields in their order, "error" nil, and the metadata read_file gives. */
#define REPLY_HEAD "\x86\xa2op\xaatool_reply\xa2id"
#define REPLY_SUCCESS "\xa7success\xc3\xa6output"
#define REPLY_META "\xa5" "error\xc0\xa8metadata\x85\xa4path"
#define REPLY_TOTAL "\xabtotal_lines"
#define REPLY_START "\xaastart_line"
#define REPLY_END "\xa8" "end_line"
/* metadata["usage"], as the Python path gives every call (activity.call_usage):
 * the CPU time of the thread that answered, and the process's peak resident
 * size, each a float64. */
#define REPLY_USAGE "\xa5usage\x82\xa5" "cpu_s"
#define REPLY_PEAK "\xa8peak_mib"
#define USAGE_SIZE ((Py_ssize_t)(sizeof REPLY_USAGE - 1) + 9 + (Py_ssize_t)(sizeof REPLY_PEAK - 1) + 9)

static double
thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The process's peak resident size in MiB (2 decimals), read at most every
 * 0.1 s as the Python path does (a getrusage is about 1 us). Read and written
 * with the GIL held. */
static double peak_mib, peak_at = -1.0;

static double now_s(void);

static double
peak_now(void)
{
    double now = now_s();
    if (now - peak_at >= 0.1) {
        struct rusage ru;
        if (getrusage(RUSAGE_SELF, &ru) == 0)
            peak_mib = round((double)ru.ru_maxrss / 1024.0 * 100.0) / 100.0;
        peak_at = now;
    }
    return peak_mib;
}

static unsigned char *
put_float(unsigned char *w, double v)
{
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    *w++ = 0xcb;
    return put_be(w, bits, 8);
}

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Send all of [p, p + n) on ``fd``; an error (the client gone) is the
 * Python path's too: nothing to tell. */
static void
send_all(int fd, const unsigned char *p, Py_ssize_t n)
{
    while (n > 0) {
        ssize_t sent = send(fd, p, (size_t)n, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        p += sent;
        n -= sent;
    }
}

static PyObject *draining_name;

/* The calls the lane is answering now, in this process: from before its
 * look at ``draining`` to the end of the reply's send. Read (lane_calls())
 * by a stop, which waits for them as for the Python path's calls in flight.
 * Changed and read with the GIL held only. */
static Py_ssize_t in_flight;

/* lane_calls() -> int: how many calls the lane is answering now. */
PyObject *
dl_lane_calls(PyObject *self, PyObject *unused)
{
    return PyLong_FromSsize_t(in_flight);
}

/* What serve_read was given, for each call it answers. */
typedef struct {
    int sock_fd, root_fd;
    Py_ssize_t cap, sniff, max_frame;
    PyObject *acquire, *release, *server;
} Lane;

/* Answer ``call``: 1 once its reply is sent; 0 when it is the Python
 * path's (the server draining, the file not opened or not text, lines past
 * the end, a reply over the frame limit, no memory: nothing sent, no error
 * left set); -1 with the error set (the send lock's calls failed). */
static int
answer(const Lane *lane, const Call *call)
{
    if (draining_name == NULL && (draining_name = PyUnicode_InternFromString("draining")) == NULL)
        goto back;
    PyObject *draining = PyObject_GetAttr(lane->server, draining_name);
    if (draining == NULL)
        goto back;
    int stopping = PyObject_IsTrue(draining);
    Py_DECREF(draining);
    if (stopping != 0)  /* refused by the Python path, in its words (or an error: the Python path too) */
        goto back;

    double cpu_before = thread_cpu_s();
    int fd = dl_open_beneath(lane->root_fd, call->path, call->path_len);
    if (fd < 0)
        goto back;
    PyObject *data = dl_read_whole(fd, lane->cap, lane->sniff);
    if (data == NULL)
        goto back;  /* no memory: the Python path's turn, which words it */
    if (!PyBytes_Check(data)) {  /* None or False: not a regular text file within the cap, or changing */
        Py_DECREF(data);
        goto back;
    }
    const char *bytes = PyBytes_AS_STRING(data);
    DlNumbering plan;
    if (dl_number_plan(bytes, PyBytes_GET_SIZE(data), (Py_ssize_t)call->start, (Py_ssize_t)call->end, &plan) != 0) {
        Py_DECREF(data);  /* past the end: read_file words it */
        goto back;
    }
    /* The text: the numbered bytes themselves when ASCII; otherwise their
     * UTF-8 after decoding with U+FFFD for invalid sequences, as Python's. */
    PyObject *decoded = NULL;
    const char *text = NULL;
    Py_ssize_t text_len = plan.size;
    if (!dl_number_ascii(bytes, &plan)) {
        char *scratch = PyMem_Malloc(plan.size > 0 ? (size_t)plan.size : 1);
        if (scratch == NULL) {
            Py_DECREF(data);
            goto back;
        }
        char *end = dl_number_write(bytes, &plan, scratch);
        decoded = PyUnicode_DecodeUTF8(scratch, end - scratch, "replace");
        PyMem_Free(scratch);
        if (decoded == NULL || (text = PyUnicode_AsUTF8AndSize(decoded, &text_len)) == NULL) {
            Py_XDECREF(decoded);
            Py_DECREF(data);
            goto back;
        }
        /* A U+FFFD shown may stand for bytes that are not UTF-8, which
         * read_file then says in a last line (files.py): the Python path's. */
        if (PyUnicode_FindChar(decoded, 0xFFFD, 0, PyUnicode_GET_LENGTH(decoded), 1) != -1) {
            Py_DECREF(decoded);
            Py_DECREF(data);
            goto back;
        }
    }
    int64_t last = call->end == -1 ? plan.total - 1 : (call->end < plan.total - 1 ? call->end : plan.total - 1);
    Py_ssize_t size = (Py_ssize_t)(sizeof REPLY_HEAD - 1) + int_size(call->id) + (Py_ssize_t)(sizeof REPLY_SUCCESS - 1)
        + str_header_size(text_len) + text_len + (Py_ssize_t)(sizeof REPLY_META - 1)
        + str_header_size(call->path_len) + call->path_len + (Py_ssize_t)(sizeof REPLY_TOTAL - 1)
        + int_size(plan.total) + (Py_ssize_t)(sizeof REPLY_START - 1) + int_size(call->start)
        + (Py_ssize_t)(sizeof REPLY_END - 1) + int_size(last) + USAGE_SIZE;
    if (size > lane->max_frame || size > (Py_ssize_t)UINT32_MAX) {  /* the Python path says it is too large */
        Py_XDECREF(decoded);
        Py_DECREF(data);
        goto back;
    }
    unsigned char *frame = PyMem_Malloc((size_t)size + 4);
    if (frame == NULL) {
        Py_XDECREF(decoded);
        Py_DECREF(data);
        goto back;
    }
    unsigned char *w = put_be(frame, (uint64_t)size, 4);
    w = put_raw(w, REPLY_HEAD);
    w = put_int(w, call->id);
    w = put_raw(w, REPLY_SUCCESS);
    w = put_str_header(w, text_len);
    if (decoded == NULL)
        w = (unsigned char *)dl_number_write(bytes, &plan, (char *)w);
    else
        memcpy(w, text, (size_t)text_len), w += text_len;
    w = put_raw(w, REPLY_META);
    w = put_str_header(w, call->path_len);
    memcpy(w, call->path, (size_t)call->path_len);
    w += call->path_len;
    w = put_raw(w, REPLY_TOTAL);
    w = put_int(w, plan.total);
    w = put_raw(w, REPLY_START);
    w = put_int(w, call->start);
    w = put_raw(w, REPLY_END);
    w = put_int(w, last);
    w = put_raw(w, REPLY_USAGE);
    w = put_float(w, round((thread_cpu_s() - cpu_before) * 1e6) / 1e6);
    w = put_raw(w, REPLY_PEAK);
    w = put_float(w, peak_now());
    Py_XDECREF(decoded);
    Py_DECREF(data);
    if (w - frame != size + 4) {  /* never: size counts what is written */
        PyMem_Free(frame);
        PyErr_SetString(PyExc_SystemError, "serve_read: the reply's size was miscounted");
        return -1;
    }
    PyObject *held = PyObject_CallNoArgs(lane->acquire);
    if (held == NULL) {
        PyMem_Free(frame);
        return -1;
    }
    Py_DECREF(held);
    Py_BEGIN_ALLOW_THREADS
    send_all(lane->sock_fd, frame, size + 4);
    Py_END_ALLOW_THREADS
    PyMem_Free(frame);
    PyObject *freed = PyObject_CallNoArgs(lane->release);
    if (freed == NULL)
        return -1;
    Py_DECREF(freed);
    return 1;

back:
    PyErr_Clear();
    return 0;
}

/* The most one recv takes: a page, on the stack. A read_file request is
 * under a hundred bytes, and a page holds dozens sent together; a larger
 * request (a write_file's content) is handed back after its first page
 * and the Python path reads the rest. A buffer held by each channel, or a
 * larger one on the stack (which a compiler's stack-clash probes would
 * touch whole), would cost every waiting reader its pages. */
#define RECV_MAX 4096

/* serve_read(sock_fd, root_fd, cap, sniff, max_frame, acquire, release, server)
 *     -> float | bytes | (list[float], bytes)
 *
 * One recv on ``sock_fd`` without the GIL; then each whole frame at the
 * front of what came that holds the usual read_file call (above) is
 * answered, in order, while the server is not draining: the file ``path``
 * read below ``root_fd`` (dl_open_beneath, dl_read_whole with ``cap`` and
 * ``sniff``), numbered, and the ToolReply frame sent between ``acquire()``
 * and ``release()`` (the channel's send lock: a slow call's output may be on
 * its way). The first frame that is not answered ends it, and it and all
 * after it are handed back. Returns the seconds of the one call answered
 * when it was all that came (the usual case); the bytes that came when none
 * was answered (b"": the peer closed); else the seconds of each call
 * answered and the bytes handed back (several calls sent at once, by threads
 * sharing a session). A call's seconds run from the request's arrival (or
 * the previous reply's send) to its reply's send. A failed recv raises its
 * OSError (BlockingIOError for SO_RCVTIMEO), as socket.recv does. */
PyObject *
dl_serve_read(PyObject *self, PyObject *args)
{
    Lane lane;
    if (!PyArg_ParseTuple(args, "iinnnOOO:serve_read", &lane.sock_fd, &lane.root_fd, &lane.cap, &lane.sniff,
                          &lane.max_frame, &lane.acquire, &lane.release, &lane.server))
        return NULL;
    if (lane.cap < 0 || lane.sniff < 0 || lane.max_frame < 0) {
        PyErr_SetString(PyExc_ValueError, "cap, sniff and max_frame must be >= 0");
        return NULL;
    }
    unsigned char in[RECV_MAX];
    ssize_t got;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    do {
        got = recv(lane.sock_fd, in, sizeof in, 0);
    } while (got < 0 && errno == EINTR);
    if (got < 0)
        err = errno;
    Py_END_ALLOW_THREADS
    if (got < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    double since = now_s(), first = 0.0;
    PyObject *times = NULL;  /* the seconds of each call answered, once there are two */
    Py_ssize_t at = 0, answered = 0;
    while (got - at > 4) {
        Py_ssize_t length = (Py_ssize_t)big_endian(in + at, 4);
        Call call;
        if (length > got - at - 4 || !read_call(in + at + 4, length, &call))
            break;
        in_flight++;  /* before answer looks at ``draining``: a stop that set it sees this call, or the call sees it */
        int done = answer(&lane, &call);
        in_flight--;
        if (done < 0) {
            Py_XDECREF(times);
            return NULL;
        }
        if (done == 0)
            break;
        double now = now_s();
        PyObject *took = NULL;
        if (answered == 0) {
            first = now - since;
        } else {
            if (times == NULL && (times = Py_BuildValue("[d]", first)) == NULL)
                return NULL;
            if ((took = PyFloat_FromDouble(now - since)) == NULL || PyList_Append(times, took) < 0) {
                Py_XDECREF(took);
                Py_DECREF(times);
                return NULL;
            }
            Py_DECREF(took);
        }
        since = now;
        answered++;
        at += 4 + length;
    }
    if (answered == 0)
        return PyBytes_FromStringAndSize((const char *)in, got);  /* not ours: what came, for the Python path */
    if (answered == 1 && at == got)
        return PyFloat_FromDouble(first);
    if (times == NULL && (times = Py_BuildValue("[d]", first)) == NULL)
        return NULL;
    return Py_BuildValue("(Ny#)", times, (const char *)in + at, (Py_ssize_t)(got - at));
}
