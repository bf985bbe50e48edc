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

/* recent_kept: the kept object files whose repository file changed since a time.
 *
 * Why: a loose object rewritten in place (made writable with chmod first)
 * changes its own ctime, not its directory's, so the end of a session
 * looks at every kept object's (dispatchd/daemon/gitguard/replaced.py,
 * find_rewritten): an fstatat each, on the close's path. In Python each
 * built a stat_result of 19 fields. The names come from the keep, not the
 * repository: what a session adds there (a million empty files) is not
 * looked at, and cannot cut the look short. The walk runs with the
 * interpreter's lock let go (the daemon's other threads go on).
 *
 * recent_kept(keep_fd, objects_fd, hex_digits, also, since_ns,
 * coarse_since_ns, limit, part=0, parts=1) -> (list[str], bool): for each
 * directory of
 * ``keep_fd`` named by ``hex_digits`` lowercase hex digits or in ``also``
 * (opened without following a symbolic link), each of its names (none
 * starting with "." or "tmp") as "dir/name" when the entry of that name
 * below ``objects_fd`` (not followed) has a st_ctime_ns of ``since_ns`` or
 * later (``coarse_since_ns`` for a ctime in whole seconds: treewalk.settled's
 * rule), or cannot be looked at for another reason than not being there
 * (EACCES: the caller decides); and whether every kept name was looked at
 * (False past ``limit`` names, or a directory that could not be read).
 * With ``parts`` > 1, only the directories whose hex value modulo ``parts``
 * is ``part`` ("pack" is part 0's): two threads, each with descriptors of
 * its own, walk the keep in half the time on two CPUs.
 */
struct names {
    char *buf;
    size_t len, cap;
};

static int
names_add(struct names *n, const char *dir, const char *name)
{
    size_t need = strlen(dir) + 1 + strlen(name) + 1;
    if (n->len + need > n->cap) {
        size_t cap = n->cap ? n->cap * 2 : 65536;
        while (cap < n->len + need)
            cap *= 2;
        char *grown = realloc(n->buf, cap);
        if (grown == NULL)
            return -1;
        n->buf = grown;
        n->cap = cap;
    }
    n->len += (size_t)sprintf(n->buf + n->len, "%s/%s", dir, name) + 1;
    return 0;
}

/* The walk, without the interpreter's lock: 0, or -1 with errno (out of memory). */
static int
walk_kept(int keep_fd, int objects_fd, Py_ssize_t digits, char **also, Py_ssize_t n_also, long long since,
          long long coarse_since, Py_ssize_t limit, int part, int parts, struct names *out, int *complete)
{
    int own = fcntl(keep_fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0)
        return -1;
    DIR *top = fdopendir(own);
    if (top == NULL) {
        close(own);
        return -1;
    }
    rewinddir(top); /* the duplicate shares the caller's offset: from the start, and left rewound */
    Py_ssize_t seen = 0;
    char path[600];
    for (;;) {
        errno = 0;
        struct dirent *entry = readdir(top);
        if (entry == NULL) {
            if (errno != 0)
                *complete = 0;
            break;
        }
        const char *dname = entry->d_name;
        int wanted = is_hex_name(dname, digits);
        for (Py_ssize_t i = 0; !wanted && i < n_also; i++)
            wanted = strcmp(dname, also[i]) == 0;
        if (!wanted || (entry->d_type != DT_DIR && entry->d_type != DT_UNKNOWN))
            continue;
        if (parts > 1 && (int)(strtol(dname, NULL, 16) % parts) != part)
            continue; /* another part's (a name not hex, "pack", is part 0's) */
        int sub = openat(dirfd(top), dname, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (sub < 0)
            continue; /* not a directory: the keep holds nothing there */
        DIR *dir = fdopendir(sub);
        if (dir == NULL) {
            close(sub);
            *complete = 0;
            continue;
        }
        for (;;) {
            errno = 0;
            struct dirent *e = readdir(dir);
            if (e == NULL) {
                if (errno != 0)
                    *complete = 0;
                break;
            }
            const char *raw = e->d_name;
            if (raw[0] == '.' || strncmp(raw, "tmp", 3) == 0)
                continue;
            if (++seen > limit) {
                *complete = 0;
                break;
            }
            if ((size_t)snprintf(path, sizeof path, "%s/%s", dname, raw) >= sizeof path)
                continue; /* longer than any object's name: nothing git keeps */
            struct stat st;
            int recent;
            if (fstatat(objects_fd, path, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                recent = errno != ENOENT && errno != ENOTDIR; /* gone: the restore's to put back */
            } else {
                long long ns = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
                recent = ns >= (ns % 1000000000LL == 0 ? coarse_since : since);
            }
            if (recent && names_add(out, dname, raw) < 0) {
                closedir(dir);
                rewinddir(top);
                closedir(top);
                return -1;
            }
        }
        closedir(dir);
        if (seen > limit)
            break;
    }
    rewinddir(top);
    closedir(top);
    return 0;
}

PyObject *
dl_recent_kept(PyObject *self, PyObject *args)
{
    int keep_fd, objects_fd;
    Py_ssize_t digits, limit;
    PyObject *also;
    long long since, coarse_since;
    int part = 0, parts = 1;
    if (!PyArg_ParseTuple(args, "iinO!LLn|ii", &keep_fd, &objects_fd, &digits, &PyTuple_Type, &also, &since,
                          &coarse_since, &limit, &part, &parts))
        return NULL;
    if (parts < 1 || part < 0 || part >= parts) {
        PyErr_SetString(PyExc_ValueError, "part must be below parts");
        return NULL;
    }
    Py_ssize_t n_also = PyTuple_GET_SIZE(also);
    if (n_also > 8) {
        PyErr_SetString(PyExc_ValueError, "at most 8 other names");
        return NULL;
    }
    char *names_also[8];
    for (Py_ssize_t i = 0; i < n_also; i++) {
        PyObject *item = PyTuple_GET_ITEM(also, i);
        if (!PyUnicode_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "the other names are strings");
            return NULL;
        }
        names_also[i] = (char *)PyUnicode_AsUTF8(item); /* kept alive by the tuple */
        if (names_also[i] == NULL)
            return NULL;
    }
    struct names out = {NULL, 0, 0};
    int complete = 1, rc, saved = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = walk_kept(keep_fd, objects_fd, digits, names_also, n_also, since, coarse_since, limit, part, parts, &out,
                   &complete);
    saved = errno;
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        free(out.buf);
        errno = saved;
        return PyErr_SetFromErrno(PyExc_OSError);
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
    if (found == NULL)
        return NULL;
    PyObject *result = Py_BuildValue("(OO)", found, complete ? Py_True : Py_False);
    Py_DECREF(found);
    return result;
}
