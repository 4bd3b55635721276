"""What of a backend URI may leave this client, and what a typed URI brings with it.

A backend URI has three kinds of parts:

- the *shared* part: scheme, host, path and the options every client must agree on
  (``logs=``, ``transfers=``, ``endpoint=``...). It goes into the repository
  configuration that every backend stores and every client follows;
- *secrets*: the password of ``user:password@``;
- *local options*: options that name something of this machine -- a program to run
  (rclone's ``binary=``), a file to read (``config=``, ``identity=``, ``known_hosts=``,
  ``ca=``), a local identity to use (``profile=``, ``account=``), an address to send
  this machine's tokens to (``api=``) or a consent to send a password in clear
  (``plain_http=``).

Secrets and local options never travel in the shared configuration: they are kept in
this client's ``.metasync/state.db`` (``LocalState.uri_overrides``, by backend id),
and an option of this kind found in a shared URI (written by an attacker, or by old
code) is dropped, never obeyed (:func:`public_uri`). Shared settings are data, never
instructions.

Environment credentials (``METASYNC_WEBDAV_USER``/``METASYNC_WEBDAV_PASSWORD``,
``METASYNC_SFTP_PASSWORD``) are bound to a host by being typed: :func:`typed_uri`
applies them only to a URI given on this machine's command line (``init``, ``clone``,
``backend add``, ``backend connect``, ``recover``), which is then stored with them,
for that backend id only. A backend never reads them itself, so a URI from the
shared configuration is never sent this machine's environment passwords. Over plain
HTTP (``webdav:``) they are refused unless that URI says ``plain_http=1``.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field
from urllib.parse import quote, unquote, unquote_plus, urlsplit

from metasync.errors import UsageError

#: Options that name something of this machine, by URI scheme (see the module docstring).
#: Each backend's own option list includes these; none of them is ever shared.
LOCAL_OPTIONS: dict[str, frozenset[str]] = {
    # A program to run and a file naming remotes (with their credentials).
    "rclone": frozenset({"binary", "config"}),
    # A private key file and the file of trusted host keys.
    "sftp": frozenset({"identity", "known_hosts"}),
    # A CA file to trust; the consent to send a password over plain HTTP.
    "webdav": frozenset({"ca", "plain_http"}),
    "webdavs": frozenset({"ca", "plain_http"}),
    # Which of this machine's AWS identities to use (a profile may run a program).
    "s3": frozenset({"profile"}),
    # Which of this machine's sign-in grants; where its tokens are sent; a CA file.
    "dropbox": frozenset({"account", "api", "ca"}),
    "box": frozenset({"account", "api", "ca"}),
    "onedrive": frozenset({"account", "api", "ca"}),
    "gdrive": frozenset({"account", "api", "ca"}),
}

#: Kinds of backend this client opens from the shared configuration without being
#: told to (``metasync backend connect``): those that reach nothing but storage on
#: this machine and use none of its credentials. A ``dir:`` folder is used only if it
#: already holds this repository's descriptor for that backend (checked by the
#: caller); ``memory:`` lives in this process only. Every other kind reaches a service
#: with this machine's credentials (SSH keys and agent, the AWS chain, rclone's
#: config, sign-in grants, passwords) at an address another client chose.
AUTOMATIC_SCHEMES: frozenset[str] = frozenset({"dir", "memory"})

#: Values of ``plain_http=`` that mean yes.
_YES = frozenset({"1", "yes", "true"})


def scheme_of(uri: str) -> str:
    """The URI's scheme; a bare absolute path is ``dir``."""
    if uri.startswith("/"):
        return "dir"
    scheme, sep, _ = uri.partition(":")
    if not sep or not scheme:
        raise UsageError(
            f"not a backend URI: {uri!r}; use dir:/absolute/path (or a bare absolute path)"
        )
    return scheme


def _split_query(scheme: str, uri: str) -> tuple[str, str]:
    """``(uri without its options, option string)``. rclone's options follow the
    *last* ``?`` (its remote path may hold one in a connection string); every other
    scheme's the first, as in any URL."""
    base, sep, query = uri.rpartition("?") if scheme == "rclone" else uri.partition("?")
    return (base, query) if sep else (uri, "")


def _name(part: str) -> str:
    return unquote_plus(part.partition("=")[0])


def local_options(uri: str) -> dict[str, str]:
    """The local options of ``uri`` by name (their values percent-decoded)."""
    try:
        scheme = scheme_of(uri)
    except UsageError:
        return {}
    local = LOCAL_OPTIONS.get(scheme)
    if not local:
        return {}
    _, query = _split_query(scheme, uri)
    out = {}
    for part in query.split("&") if query else ():
        if _name(part) in local:
            out[_name(part)] = unquote_plus(part.partition("=")[2])
    return out


def without_local_options(uri: str) -> str:
    """``uri`` without its local options; the other options are kept byte for byte
    (so a URI without local options comes back unchanged)."""
    try:
        scheme = scheme_of(uri)
    except UsageError:
        return uri
    local = LOCAL_OPTIONS.get(scheme)
    if not local:
        return uri
    base, query = _split_query(scheme, uri)
    if not query:
        return uri
    parts = query.split("&")
    kept = [p for p in parts if _name(p) not in local]
    if len(kept) == len(parts):
        return uri
    return f"{base}?{'&'.join(kept)}" if kept else base


def public_uri(uri: str) -> str:
    """``uri`` as it may leave this client -- in messages and in the repository
    configuration every backend stores: without the password of its
    ``user:password@`` part and without its local options."""
    uri = without_local_options(uri)
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    authority, slash, path = rest.partition("/")
    userinfo, at, host = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return uri
    return f"{scheme}://{userinfo.split(':', 1)[0]}@{host}{slash}{path}"


def typed_uri(uri: str) -> str:
    """A URI given on this machine's command line, completed with the environment's
    credentials for it: ``METASYNC_WEBDAV_USER``/``METASYNC_WEBDAV_PASSWORD`` for a
    ``webdav(s):`` URI without them, ``METASYNC_SFTP_PASSWORD`` for an ``sftp:`` URI
    without a password. The result carries them inline and is stored only in this
    client's local state, bound to that backend, so they go to no other host.

    Raises :class:`UsageError` if environment credentials would go over plain HTTP
    (``webdav:``) and the URI does not say ``plain_http=1``."""
    scheme = scheme_of(uri)
    parts = urlsplit(uri)
    if scheme not in ("webdav", "webdavs", "sftp") or not parts.hostname:
        return uri  # nothing to add (a malformed URI is reported when it is opened)
    if parts.password is not None:
        return uri  # the URI's own credentials
    user = unquote(parts.username) if parts.username else None
    if scheme == "sftp":
        password = os.environ.get("METASYNC_SFTP_PASSWORD")
        if not password:
            return uri
        return _with_credentials(uri, user or getpass.getuser(), password)
    env_user = os.environ.get("METASYNC_WEBDAV_USER")
    password = os.environ.get("METASYNC_WEBDAV_PASSWORD")
    if (user is None and env_user is None) or (user is not None and password is None):
        return uri
    if scheme == "webdav" and local_options(uri).get("plain_http", "").lower() not in _YES:
        raise UsageError(
            f"METASYNC_WEBDAV_{'USER' if user is None else 'PASSWORD'} would go to "
            f"{parts.hostname} over plain HTTP in {public_uri(uri)}; use webdavs://, or add "
            "plain_http=1 to the URI's options if sending it in clear is what you want "
            "(e.g. a server on this machine)"
        )
    return _with_credentials(uri, user if user is not None else str(env_user), password)


def _with_credentials(uri: str, user: str, password: str | None) -> str:
    """``uri`` with ``user[:password]@`` as its user info (percent-encoded)."""
    parts = urlsplit(uri)
    host = parts.netloc.rpartition("@")[2]
    secret = f":{quote(password, safe='')}" if password is not None else ""
    return parts._replace(netloc=f"{quote(user, safe='')}{secret}@{host}").geturl()


# --- what a backend URI names -------------------------------------------------------

#: Default ports of the URL schemes, so ``host:80`` and ``host`` are one server.
_DEFAULT_PORTS = {"webdav": 80, "webdavs": 443, "sftp": 22}
#: Options that choose *which* service a URI reaches (the rest -- ``transfers=``,
#: ``logs=``, ``timeout=`` -- only say how it is used): an S3 endpoint, a cloud
#: provider's sign-in and API address.
_SERVICE_OPTIONS = frozenset({"endpoint", "account", "api"})


@dataclass(frozen=True)
class Location:
    """What a backend URI names, for telling two backends apart
    (:func:`location_identity`): the service, the folder's path on it as normalised
    segments, and for ``dir:`` the folder's device and inode and those of its
    existing ancestors (so a bind mount or hard-to-see alias is caught too).

    Two URIs name the same folder if service and path are equal or (``dir:``) the
    inodes are; one is inside the other if its path extends the other's or
    (``dir:``) one of its ancestors is the other's inode (:meth:`relation`)."""

    service: tuple[str, ...]
    path: tuple[str, ...]
    inode: tuple[int, int] | None = field(default=None, compare=False)
    ancestors: frozenset[tuple[int, int]] = field(default=frozenset(), compare=False)

    def relation(self, other: Location) -> str | None:
        """``"same"`` if both name one folder, ``"inside"`` if this one is inside
        ``other``'s, else None."""
        if self.inode is not None and self.inode == other.inode:
            return "same"
        if self.service != other.service:
            return None
        if self.path == other.path:
            return "same"
        if self.path[: len(other.path)] == other.path:
            return "inside"
        if other.inode is not None and other.inode in self.ancestors:
            return "inside"
        return None


def _segments(path: str) -> tuple[str, ...]:
    """``path`` percent-decoded, as segments with ``//``, ``.`` and ``..`` resolved and
    no trailing slash (a ``..`` above the top stays at the top, as on a server)."""
    out: list[str] = []
    for part in unquote(path).split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if out:
                out.pop()
            continue
        out.append(part)
    return tuple(out)


def _service_options(query: str) -> tuple[str, ...]:
    """The options of ``query`` that choose the service, sorted, values normalised."""
    found = []
    for part in query.split("&") if query else ():
        name, _, value = part.partition("=")
        name = unquote_plus(name)
        if name in _SERVICE_OPTIONS:
            found.append(f"{name}={unquote_plus(value).rstrip('/').lower()}")
    return tuple(sorted(found))


def _dir_location(path: str) -> Location:
    """A ``dir:`` folder by its real path (symlinks, ``..`` and ``//`` resolved), and
    its device and inode and those of its existing ancestors."""
    real = os.path.realpath(path)
    inode = None
    ancestors: set[tuple[int, int]] = set()
    probe = real
    while True:
        try:
            st = os.stat(probe)
        except OSError:
            pass  # not created yet (init --mkdir): compared by its path alone
        else:
            if probe == real:
                inode = (st.st_dev, st.st_ino)
            else:
                ancestors.add((st.st_dev, st.st_ino))
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return Location(("dir",), _segments(real), inode, frozenset(ancestors))


def location_identity(uri: str) -> Location:
    """What backend ``uri`` names (see :class:`Location`), however it is spelled:
    ``dir:`` by real path and inode; ``webdav(s):``/``sftp:`` by scheme, lower-case
    host, port (the default one filled in), the user for ``sftp:`` (whose paths may be
    relative to a home folder) and the normalised path (percent-decoding, ``//``,
    ``.``, ``..``, trailing slash); ``s3:`` by bucket, endpoint and prefix;
    ``rclone:`` by remote and normalised path; other kinds by scheme, the options that
    choose the account, and the normalised path. Reads the filesystem for ``dir:``
    only; never contacts a service."""
    scheme = scheme_of(uri)
    if scheme == "dir":
        path = uri[len("dir:"):] if uri.startswith("dir:") else uri
        return _dir_location(path)
    base, query = _split_query(scheme, uri)
    service_options = _service_options(query)
    if scheme in ("webdav", "webdavs", "sftp", "s3"):
        parts = urlsplit(base)
        try:
            port = parts.port
        except ValueError:
            port = None
        user = unquote(parts.username or "") if scheme == "sftp" else ""
        host = parts.hostname or ""
        service = (scheme, user, host, str(port or _DEFAULT_PORTS.get(scheme) or ""),
                   *service_options)
        return Location(service, _segments(parts.path))
    rest = base[len(scheme) + 1:]
    if scheme == "rclone":
        remote, _, path = rest.rpartition(":")
        return Location((scheme, remote, *service_options), _segments(path))
    return Location((scheme, *service_options), _segments(rest))


def overlap(uris: list[str], *, root: str | None, existing: list[str] | None = None) -> None:
    """Raise :class:`UsageError` (one line, naming both URIs as given) if two of
    ``uris`` -- or one of them and one of ``existing`` (a repository's backends) --
    name the same folder or one lies inside the other, or if a ``dir:`` one lies
    inside the synced folder ``root`` (its objects would be synced as files). Each must be a distinct store: a second spelling
    of one folder would count one physical copy as two."""
    seen = []
    for uri in existing or ():
        try:
            seen.append((public_uri(uri), location_identity(uri)))
        except UsageError:
            continue  # a shared URI this client cannot read names nothing it could reach
    synced = _dir_location(root) if root is not None else None
    for uri in uris:
        shown = public_uri(uri)
        here = location_identity(uri)
        if (synced is not None and here.service == ("dir",)
                and here.relation(synced) is not None):
            raise UsageError(
                f"{shown} is inside the synced folder {root}; keep backends outside it "
                "(their files would be synced too)")
        for other_shown, other in seen:
            relation = here.relation(other)
            if relation == "same":
                raise UsageError(f"{shown} and {other_shown} are the same backend location; "
                                 "give each backend once (each must be a separate store)")
            if relation is None and other.relation(here) == "inside":
                shown, other_shown, relation = other_shown, shown, "inside"
            if relation == "inside":
                raise UsageError(f"{shown} is inside the backend location {other_shown}; "
                                 "give backends that do not hold one another")
        seen.append((shown, here))
