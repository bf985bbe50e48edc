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

/* recent_files: the files of those subdirectories changed since a time.
 *
 * Why: a loose object rewritten in place (made writable with chmod first)
 * changes its own ctime, not its directory's, so the end of a session
 * looks at every loose object's (dispatchd/daemon/gitguard/replaced.py,
 * find_rewritten): an fstatat each, on the close's path. In Python each
 * built a stat_result of 19 fields (1.7 us a file, 2.1 ms for the listings
 * of 256 directories).
 *
 * recent_files(fd, hex_digits, since_ns, coarse_since_ns, limit) ->
 * (list[str], bool): each "dir/name" (``dir`` of ``hex_digits`` lowercase
 * hex digits, a directory opened below ``fd`` without following a symbolic
 * link or blocking; every entry of it but "." and "..", whatever its kind,
 * not followed) whose st_ctime_ns is ``since_ns`` or later, or
 * ``coarse_since_ns`` or later for a ctime in whole seconds (a file system
 * that keeps no finer: treewalk.settled's rule); and whether every entry was looked
 * at (False past ``limit`` entries in all: the caller reports the look as
 * cut short). An entry gone between the listing and its stat is left out.
 */
PyObject *
dl_recent_files(PyObject *self, PyObject *args)
{
    int fd;
    Py_ssize_t digits;
    long long since, coarse_since;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "inLLn", &fd, &digits, &since, &coarse_since, &limit))
        return NULL;
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    DIR *top = fdopendir(own);
    if (top == NULL) {
        close(own);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    rewinddir(top);
    PyObject *found = PyList_New(0);
    Py_ssize_t seen = 0;
    int complete = 1;
    if (found == NULL)
        goto fail;
    for (;;) {
        errno = 0;
        struct dirent *entry = readdir(top);
        if (entry == NULL) {
            if (errno != 0) {
                PyErr_SetFromErrno(PyExc_OSError);
                goto fail;
            }
            break;
        }
        const char *dname = entry->d_name;
        if (!is_hex_name(dname, digits) || (entry->d_type != DT_DIR && entry->d_type != DT_UNKNOWN))
            continue;
        int sub = openat(dirfd(top), dname, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (sub < 0)
            continue; /* gone, or not a directory (a symlink): nothing git reads as one */
        DIR *dir = fdopendir(sub);
        if (dir == NULL) {
            close(sub);
            continue;
        }
        for (;;) {
            errno = 0;
            struct dirent *e = readdir(dir);
            if (e == NULL)
                break; /* the end, or an error reading it: what was listed is looked at */
            const char *raw = e->d_name;
            if (raw[0] == '.' && (raw[1] == '\0' || (raw[1] == '.' && raw[2] == '\0')))
                continue;
            if (++seen > limit) {
                complete = 0;
                break;
            }
            struct stat st;
            if (fstatat(dirfd(dir), raw, &st, AT_SYMLINK_NOFOLLOW) != 0)
                continue;
            long long ns = (long long)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec;
            if (ns < (ns % 1000000000LL == 0 ? coarse_since : since))
                continue;
            PyObject *rel = PyUnicode_FromFormat("%s/", dname);
            PyObject *name = PyUnicode_DecodeFSDefault(raw);
            if (rel != NULL && name != NULL)
                PyUnicode_Append(&rel, name);
            Py_XDECREF(name);
            if (rel == NULL || name == NULL || PyList_Append(found, rel) < 0) {
                Py_XDECREF(rel);
                closedir(dir);
                goto fail;
            }
            Py_DECREF(rel);
        }
        closedir(dir);
        if (!complete)
            break;
    }
    rewinddir(top);
    closedir(top);
    PyObject *result = Py_BuildValue("(OO)", found, complete ? Py_True : Py_False);
    Py_DECREF(found);
    return result;
fail:
    rewinddir(top);
    closedir(top);
    Py_XDECREF(found);
    return NULL;
}
