/* subdir_ctimes: the change time of each subdirectory of a directory, by
 * name: the look git's object directories get at every open and close
 * (dispatchd/daemon/gitguard/history.py, _stamps).
 *
 * Why: 256 object directories are 256 stats; in Python each builds a
 * stat_result of 19 fields, 40% of the look (0.41 ms in all, at an open
 * and again at a close, on the daemon's thread; the open's baseline join,
 * which it is part of, is the open's longest step). Here each is an
 * fstatat whose ctime alone is kept: 0.26 ms, the kernel's part.
 *
 * What it returns is what the Python look returns, entry for entry: the
 * names as os.listdir gives them (decoded as the file system's names), those
 * of ``hex_digits`` lowercase hexadecimal digits (git's fan-out directories:
 * ``ab``) or in ``also``, each a directory itself (a symbolic link is not
 * followed, and is left out), its st_ctime_ns. No other name is looked at:
 * a session that fills ``objects`` with directories of other names costs a
 * look their listing, not a stat each. An entry gone between the listing and its
 * stat is left out. The directory is read through a duplicate of ``fd``
 * (which shares its offset), from its start, and left rewound, as
 * os.listdir leaves it.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "_lines.h"

/* A name of exactly ``digits`` lowercase hexadecimal digits. */
static int
is_hex_name(const char *raw, Py_ssize_t digits)
{
    Py_ssize_t i = 0;
    for (; raw[i] != '\0'; i++) {
        if (i >= digits || !((raw[i] >= '0' && raw[i] <= '9') || (raw[i] >= 'a' && raw[i] <= 'f')))
            return 0;
    }
    return i == digits;
}

/* subdir_ctimes(fd, hex_digits, also) -> dict[str, int] */
PyObject *
dl_subdir_ctimes(PyObject *self, PyObject *args)
{
    int fd;
    Py_ssize_t digits;
    PyObject *also;
    if (!PyArg_ParseTuple(args, "inO!", &fd, &digits, &PyTuple_Type, &also))
        return NULL;
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    DIR *dir = fdopendir(own);
    if (dir == NULL) {
        close(own);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    rewinddir(dir); /* the duplicate shares the caller's offset: from the start */
    PyObject *found = PyDict_New();
    if (found == NULL)
        goto fail;
    for (;;) {
        errno = 0;
        struct dirent *entry = readdir(dir);
        if (entry == NULL) {
            if (errno != 0) {
                PyErr_SetFromErrno(PyExc_OSError);
                goto fail;
            }
            break;
        }
        const char *raw = entry->d_name;
        if (raw[0] == '.' && (raw[1] == '\0' || (raw[1] == '.' && raw[2] == '\0')))
            continue;
        if (entry->d_type != DT_DIR && entry->d_type != DT_UNKNOWN)
            continue; /* a file or a link: not a directory, as its stat would say */
        int hex = is_hex_name(raw, digits);
        PyObject *name = PyUnicode_DecodeFSDefault(raw);
        if (name == NULL)
            goto fail;
        int wanted = hex;
        if (!wanted) {
            wanted = PySequence_Contains(also, name);
            if (wanted < 0) {
                Py_DECREF(name);
                goto fail;
            }
        }
        struct stat st;
        if (wanted && fstatat(dirfd(dir), raw, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
            PyObject *ns = PyLong_FromLongLong((long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec);
            if (ns == NULL || PyDict_SetItem(found, name, ns) < 0) {
                Py_XDECREF(ns);
                Py_DECREF(name);
                goto fail;
            }
            Py_DECREF(ns);
        }
        Py_DECREF(name);
    }
    rewinddir(dir); /* as os.listdir leaves it: the caller's descriptor reads from the start again */
    closedir(dir);
    return found;
fail:
    rewinddir(dir);
    closedir(dir);
    Py_XDECREF(found);
    return NULL;
}

/* recent_named: the kept object files whose repository file changed since a time.
 *
 * Why: a loose object rewritten in place (made writable with chmod first)
 * changes its own ctime, not its directory's, so the end of a session
 * looks at every kept object's (dispatchd/daemon/gitguard/replaced.py,
 * find_rewritten): an fstatat each, on the close's path. In Python each
 * built a stat_result of 19 fields. The names come from the keep, not the
 * repository (gitguard/keptnames.py lists it, and remembers the listings of
 * its directories that have not changed): what a session adds there (a
 * million empty files) is not looked at, and cannot cut the look short.
 * The look runs with the interpreter's lock let go (the daemon's other
 * threads go on).
 *
 * recent_named(objects_fd, names, since_ns, coarse_since_ns, part=0,
 * parts=1) -> list[str]: ``names`` is "dir/name" entries, each ended by a
 * NUL byte; each is returned (decoded as the file system's names) when the
 * entry of that name below ``objects_fd`` (its last part not followed) has
 * a st_ctime_ns of ``since_ns`` or later (``coarse_since_ns`` for a ctime
 * in whole seconds: treewalk.settled's rule), or cannot be looked at for
 * another reason than not being there (EACCES: the caller decides). With
 * ``parts`` > 1, only the entries whose place in ``names`` modulo ``parts``
 * is ``part``: two threads look at half each, in half the time on two CPUs.
 */
struct names {
    char *buf;
    size_t len, cap;
};

static int
names_add(struct names *n, const char *rel, size_t len)
{
    if (n->len + len + 1 > n->cap) {
        size_t cap = n->cap ? n->cap * 2 : 65536;
        while (cap < n->len + len + 1)
            cap *= 2;
        char *grown = realloc(n->buf, cap);
        if (grown == NULL)
            return -1;
        n->buf = grown;
        n->cap = cap;
    }
    memcpy(n->buf + n->len, rel, len);
    n->buf[n->len + len] = '\0';
    n->len += len + 1;
    return 0;
}

/* The look, without the interpreter's lock: 0, or -1 (out of memory). */
static int
look_named(int objects_fd, const char *names, size_t size, long long since, long long coarse_since, int part,
           int parts, struct names *out)
{
    char path[600];
    size_t at = 0;
    for (long long i = 0; at < size; i++) {
        const char *rel = names + at;
        const char *end = memchr(rel, '\0', size - at);
        size_t len = end != NULL ? (size_t)(end - rel) : size - at;
        at += len + 1;
        if (i % parts != part || len == 0 || len >= sizeof path)
            continue; /* another part's, or longer than any object's name: nothing git keeps */
        memcpy(path, rel, len);
        path[len] = '\0';
        struct stat st;
        int recent;
        if (fstatat(objects_fd, path, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            recent = errno != ENOENT && errno != ENOTDIR; /* gone: the restore's to put back */
        } else {
            long long ns = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
            recent = ns >= (ns % 1000000000LL == 0 ? coarse_since : since);
        }
        if (recent && names_add(out, path, len) < 0)
            return -1;
    }
    return 0;
}

PyObject *
dl_recent_named(PyObject *self, PyObject *args)
{
    int objects_fd;
    Py_buffer names;
    long long since, coarse_since;
    int part = 0, parts = 1;
    if (!PyArg_ParseTuple(args, "iy*LL|ii", &objects_fd, &names, &since, &coarse_since, &part, &parts))
        return NULL;
    if (parts < 1 || part < 0 || part >= parts) {
        PyBuffer_Release(&names);
        PyErr_SetString(PyExc_ValueError, "part must be below parts");
        return NULL;
    }
    struct names out = {NULL, 0, 0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = look_named(objects_fd, names.buf, (size_t)names.len, since, coarse_since, part, parts, &out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&names);
    if (rc < 0) {
        free(out.buf);
        return PyErr_NoMemory();
    }
    PyObject *found = PyList_New(0);
    for (size_t at = 0; found != NULL && at < out.len; at += strlen(out.buf + at) + 1) {
        PyObject *rel = PyUnicode_DecodeFSDefault(out.buf + at);
        if (rel == NULL || PyList_Append(found, rel) < 0) {
            Py_XDECREF(rel);
            Py_CLEAR(found);
            break;
        }
        Py_DECREF(rel);
    }
    free(out.buf);
    return found;
}
