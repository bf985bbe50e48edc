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
