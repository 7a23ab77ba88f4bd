"""The links between services, written once: who the peers of a scaled tier are (discovery and
membership), the state each is in, a stream to one kept open across breaks, how long to wait
before trying again, the background tasks a service owns, and the files a service announces
its addresses in."""
