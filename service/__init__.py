"""The tiercache daemon: configuration, the gRPC servicer, worker registrations, and the
server's start and orderly stop. It imports the library (tiercache); nothing in the
library imports it."""
