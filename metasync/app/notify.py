"""Desktop notifications of what needs the user: a conflict, a paused folder, a
backend failing (the fleet's events of those kinds).

They go through the freedesktop notification API
(``org.freedesktop.Notifications.Notify`` on the session bus, which GNOME, KDE,
XFCE, dunst and mako all serve) with jeepney, a pure-Python D-Bus client. Without
a session bus (``DBUS_SESSION_BUS_ADDRESS`` unset: a server, a systemd unit with no
login session) or without a notification server on it, nothing is shown and
nothing fails: the page and ``/rest/events`` show every event anyway.

Events arrive on the fleet's threads; :class:`Notifier` queues them and one
thread of its own talks to the bus, so a slow or stuck bus never holds a sync.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from metasync.app.fleet import Event, EventLog

#: The event kinds a desktop notification is shown for, with their summary line.
NOTIFIED = {"conflict": "metasync: conflict", "paused": "metasync: folder paused",
            "backend-failing": "metasync: storage failing"}
#: Seconds a call to the bus may take before it is given up.
BUS_TIMEOUT = 5.0
APP_NAME = "metasync"

log = logging.getLogger("metasync.app.notify")


def session_bus_address() -> str | None:
    """The session bus's address, or None if this process has none."""
    return os.environ.get("DBUS_SESSION_BUS_ADDRESS") or None


class Notifier:
    """Shows desktop notifications of an :class:`EventLog`'s events (see the module
    docstring). :meth:`start` subscribes; :meth:`stop` ends its thread."""

    def __init__(self, events: EventLog, address: str | None = None) -> None:
        self.events = events
        #: The bus to use; None: the session bus of the environment, if any.
        self.address = address if address is not None else session_bus_address()
        self._queue: queue.Queue[Event | None] = queue.Queue(maxsize=100)
        self._thread: threading.Thread | None = None
        self._conn: Any = None
        #: Notifications the bus accepted (their ids), for the log and the tests.
        self.sent = 0

    def start(self) -> None:
        if self.address is None:
            return  # no bus: the page and the API are the only notices
        self.events.subscribe(self._offer)
        self._thread = threading.Thread(target=self._run, name="metasync-notify", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=BUS_TIMEOUT * 2)
            self._thread = None

    def _offer(self, event: Event) -> None:
        if event.kind in NOTIFIED and self._thread is not None:
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                pass  # a burst the desktop could not show anyway; the page lists them

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                break
            try:
                self._notify(NOTIFIED[event.kind], event.message)
                self.sent += 1
            except Exception as exc:  # no notification server, bus gone: never an error
                log.info("desktop notification not shown: %s", exc)
                self._close()
        self._close()

    def _notify(self, summary: str, body: str) -> None:
        from jeepney import DBusAddress, new_method_call
        from jeepney.io.blocking import open_dbus_connection

        if self._conn is None:
            self._conn = open_dbus_connection(bus=self.address)
        target = DBusAddress("/org/freedesktop/Notifications",
                             bus_name="org.freedesktop.Notifications",
                             interface="org.freedesktop.Notifications")
        # Notify(app_name, replaces_id, app_icon, summary, body, actions, hints, timeout)
        msg = new_method_call(target, "Notify", "susssasa{sv}i",
                              (APP_NAME, 0, "", summary, body, [], {}, -1))
        reply = self._conn.send_and_get_reply(msg, timeout=BUS_TIMEOUT)
        from jeepney import MessageType

        if reply.header.message_type == MessageType.error:
            raise RuntimeError(f"the notification server refused: {reply.body}")

    def _close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None
