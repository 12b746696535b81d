# CodeTests-v0's trusted harness: the program that runs as main in the sandbox, one text for
# every task (envs.codetests.verifier reads this file as HARNESS; envs.sandbox.preload
# compiles it once in bwrap's fork server). Never imported on the host.
#
# It reads 'tests.marshal' (verifier.TESTS_FILE, beside solution.py): the nonce, the function's
# name and the test inputs, never the expected values. It imports solution.py as importlib
# would, calls the function once per input inside try/except BaseException, and writes one
# record to fd 1: the nonce, then JSON with per test the returned value in a tagged encoding
# that admits only exact plain types, or the exception's type name, or "non_plain" with the
# type's name. No method of a returned value is ever called. It imports only modules built
# into the interpreter or tiny ones (json, os, importlib would cost ~10 ms a run), and binds
# the builtins it uses before the solution can replace them.
#
# ruff: noqa: E401, E402, I001, UP031
import sys
sys.dont_write_bytecode = True
import marshal, posix, warnings  # built in / tiny: json, os, importlib would cost ~10 ms a run
warnings.simplefilter("ignore")


def _slurp(name):
    fd, data = posix.open(name, posix.O_RDONLY), b""
    while chunk := posix.read(fd, 65536):
        data += chunk
    posix.close(fd)
    return data


NONCE, FUNCTION, INPUTS = marshal.loads(_slurp('tests.marshal'))
_type, _str, _vars, _issubclass, _len, _ord = type, str, vars, issubclass, len, ord
_write, _exit, _BaseException = posix.write, posix._exit, BaseException
_getattr, _modules = getattr, sys.modules
_PLAIN = (bool, int, float, str, list, tuple, dict)
_NONE = type(None)


class _NonPlain(Exception):
    pass


class _Unencodable(Exception):
    pass


_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _quote(s):
    if s.isascii() and s.isprintable() and '"' not in s and "\\" not in s:
        return '"' + s + '"'
    out = []
    for c in s:
        o = _ord(c)
        if c in _SHORT:
            out.append(_SHORT[c])
        elif 32 <= o < 127:
            out.append(c)
        elif o < 65536:
            out.append("\\u%04x" % o)
        else:
            o -= 65536
            out.append("\\u%04x\\u%04x" % (0xD800 + (o >> 10), 0xDC00 + (o & 0x3FF)))
    return '"' + "".join(out) + '"'


def _dumps(x):  # JSON, as json.dumps writes it, of what _entry builds: lists, str, bool, None
    t = _type(x)
    if t is _str:
        return _quote(x)
    if t is list:
        return "[" + ", ".join([_dumps(v) for v in x]) + "]"
    if x is None:
        return "null"
    if x is True or x is False:
        return "true" if x else "false"
    raise _Unencodable()


def _encode(x, depth=0):
    t = _type(x)
    if depth > 32:
        raise _Unencodable()
    if t is bool:
        return ["bool", x]
    if t is int:
        return ["int", _str(x)]
    if t is float:
        return ["float", float.hex(x)]
    if t is str:
        return ["str", x]
    if t is _NONE:
        return ["none"]
    if t is list or t is tuple:
        return ["list" if t is list else "tuple", [_encode(v, depth + 1) for v in x]]
    if t is dict:
        items = []
        for k, v in dict.items(x):
            if _type(k) is not str:
                raise _NonPlain(k)
            items.append([k, _encode(v, depth + 1)])
        return ["dict", items]
    raise _NonPlain(x)


def _name(t):
    try:
        name = _type.__dict__["__name__"].__get__(t)
        return name if _type(name) is str else "?"
    except _BaseException:
        return "?"


def _suspicious(x):
    try:
        t = _type(x)
        if _issubclass(t, _PLAIN):
            return True
        for k in _type.__dict__["__mro__"].__get__(t)[:-1]:
            d = _type.__dict__["__dict__"].__get__(k)
            if "__eq__" in d and d.get("__module__", "builtins") != "builtins":
                return True
        return False
    except _BaseException:
        return True


def _entry(out):
    try:
        entry = ["value", _encode(out)]
    except _NonPlain as bad:
        obj = bad.args[0]
        entry = ["non_plain", _name(_type(obj)), _suspicious(obj)]
    except _BaseException:
        entry = ["unencodable"]
    if entry[0] == "value" and _len(_dumps(entry)) > 65536:
        entry = ["unencodable"]
    return entry


import_error = None
fn = None
sys.path.insert(0, posix.getcwd())
try:  # import solution as importlib would, without its machinery (~0.5 ms of a short run)
    _path = posix.getcwd() + "/solution.py"
    _module = type(sys)("solution")
    _module.__file__, _module.__cached__, _module.__package__ = _path, None, ""
    _modules["solution"] = _module
    exec(compile(_slurp("solution.py"), _path, "exec"), _module.__dict__)
    fn = _getattr(_modules["solution"], FUNCTION)  # the module may have replaced itself
except _BaseException as exc:
    import_error = _name(_type(exc))
results = []
for args in INPUTS:
    if import_error is not None:
        results.append(["raised", import_error])
        continue
    try:
        out = fn(*args)
    except _BaseException as exc:
        results.append(["raised", _name(_type(exc))])
        continue
    results.append(_entry(out))
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except _BaseException:
        pass
data = ("\n" + NONCE + ' {"import_error": ' + _dumps(import_error) + ', "results": '
        + _dumps(results) + "}\n").encode("ascii")
while data:
    data = data[_write(1, data):]
_exit(0)
