//! Watching the HTTP/2 frames on each accepted connection, so that a failure below gRPC (a stream
//! the HTTP/2 layer resets, a connection it closes with an error, a peer that does not speak
//! HTTP/2) is logged at warn with the socket and the request that caused it.
//!
//! Such failures never reach a tonic service: h2 answers a request with malformed headers by
//! resetting its stream itself and logs only at debug. That is how the kubelet's failed
//! registrations (issue 11: `GetInfo ... RST_STREAM with error code: PROTOCOL_ERROR`) went
//! unseen on the plugin side. [`Tapped`] wraps the socket, passes every byte through untouched,
//! and parses a copy of both directions (RFC 9113 framing, RFC 7541 HPACK for the requests'
//! headers) to report:
//! - RST_STREAM we send, with the stream's `:method`, `:path`, `:authority` and `user-agent`;
//! - RST_STREAM the peer sends, except `CANCEL` and `NO_ERROR` (a client's deadline or
//!   cancellation, which gRPC reports itself);
//! - GOAWAY from either side with an error code;
//! - a connection that does not open with the HTTP/2 client preface.
//!
//! Observation is best effort and bounded: a header block over [`MAX_BLOCK`] or a copy that stops
//! parsing (an HPACK error) ends observation of what the peer sends on that connection (resets
//! are then reported without their request), never the connection.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// The HTTP/2 client connection preface (RFC 9113, section 3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The largest header block (HEADERS plus CONTINUATION) or control frame payload we copy.
pub const MAX_BLOCK: usize = 64 * 1024;
/// How many streams' requests are remembered per connection for reports.
const REMEMBERED_STREAMS: usize = 64;

const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// The name of an HTTP/2 error code (RFC 9113, section 7).
pub fn reason_name(code: u32) -> String {
    match code {
        0x0 => "NO_ERROR".into(),
        0x1 => "PROTOCOL_ERROR".into(),
        0x2 => "INTERNAL_ERROR".into(),
        0x3 => "FLOW_CONTROL_ERROR".into(),
        0x4 => "SETTINGS_TIMEOUT".into(),
        0x5 => "STREAM_CLOSED".into(),
        0x6 => "FRAME_SIZE_ERROR".into(),
        0x7 => "REFUSED_STREAM".into(),
        0x8 => "CANCEL".into(),
        0x9 => "COMPRESSION_ERROR".into(),
        0xa => "CONNECT_ERROR".into(),
        0xb => "ENHANCE_YOUR_CALM".into(),
        0xc => "INADEQUATE_SECURITY".into(),
        0xd => "HTTP_1_1_REQUIRED".into(),
        other => format!("0x{other:x}"),
    }
}

/// What a request looked like on the wire, from its HEADERS.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WireRequest {
    /// `:method`.
    pub method: String,
    /// `:path`, e.g. `/pluginregistration.Registration/GetInfo`.
    pub path: String,
    /// `:authority`, as sent (the kubelet's registration dial sends the percent-encoded path).
    pub authority: String,
    /// `user-agent`, e.g. `grpc-go/1.79.3`.
    pub user_agent: String,
}

/// A transport-level failure on one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportEvent {
    /// We (the HTTP/2 layer) reset a stream.
    ResetByUs {
        /// The stream ID.
        stream: u32,
        /// The error code's name.
        reason: String,
        /// The stream's request, when its HEADERS were seen and decoded.
        request: Option<WireRequest>,
    },
    /// The peer reset a stream with an error (not `CANCEL` or `NO_ERROR`).
    ResetByPeer {
        /// The stream ID.
        stream: u32,
        /// The error code's name.
        reason: String,
        /// The stream's request, when known.
        request: Option<WireRequest>,
    },
    /// A GOAWAY with an error code.
    GoAway {
        /// `true`: we sent it; `false`: the peer did.
        by_us: bool,
        /// The error code's name.
        reason: String,
        /// Its debug data, lossily as UTF-8.
        debug: String,
    },
    /// The peer's first bytes are not the HTTP/2 client preface.
    NotHttp2 {
        /// Up to the preface's length of what it sent, escaped.
        start: String,
    },
}

/// Receives the events of every tapped connection.
pub trait TransportObserver: Send + Sync + 'static {
    /// Called once per event, on the connection's task; must not block.
    fn observe(&self, socket: &str, event: TransportEvent);
}

/// Logs every event at warn, naming the socket.
#[derive(Debug, Default, Clone, Copy)]
pub struct WarnLog;

impl TransportObserver for WarnLog {
    fn observe(&self, socket: &str, event: TransportEvent) {
        match event {
            TransportEvent::ResetByUs {
                stream,
                reason,
                request,
            } => {
                let r = request.unwrap_or_default();
                tracing::warn!(socket, stream, %reason, method = %r.method, path = %r.path,
                    authority = %r.authority, user_agent = %r.user_agent,
                    "HTTP/2 layer reset the peer's request before it reached the service");
            }
            TransportEvent::ResetByPeer {
                stream,
                reason,
                request,
            } => {
                let r = request.unwrap_or_default();
                tracing::warn!(socket, stream, %reason, path = %r.path,
                    user_agent = %r.user_agent, "peer reset its request");
            }
            TransportEvent::GoAway {
                by_us,
                reason,
                debug: data,
            } => {
                let by = if by_us { "we" } else { "the peer" };
                tracing::warn!(socket, %reason, debug_data = %data,
                    "{by} closed the HTTP/2 connection with an error");
            }
            TransportEvent::NotHttp2 { start } => {
                tracing::warn!(socket, start = %start, "peer does not speak HTTP/2 (no client preface)");
            }
        }
    }
}

/// One direction's frame parser.
#[derive(Default)]
struct Frames {
    /// Bytes of the current frame header or copied payload.
    buf: Vec<u8>,
    /// The current frame's header, once complete: (length, type, flags, stream).
    header: Option<(usize, u8, u8, u32)>,
    /// Payload bytes of the current frame still to skip without copying.
    skip: usize,
}

enum Parsed {
    Frame(u8, u8, u32, Vec<u8>),
    /// A frame whose payload was skipped (not copied).
    Skipped,
}

impl Frames {
    /// Feeds `bytes`, returning each frame of interest completed by them.
    fn feed(&mut self, mut bytes: &[u8], wanted: impl Fn(u8) -> bool) -> Result<Vec<Parsed>, ()> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(bytes.len());
                self.skip -= n;
                bytes = &bytes[n..];
                if self.skip == 0 {
                    out.push(Parsed::Skipped);
                }
                continue;
            }
            match self.header {
                None => {
                    let n = (9 - self.buf.len()).min(bytes.len());
                    self.buf.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    if self.buf.len() == 9 {
                        let b = &self.buf;
                        let len =
                            usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
                        let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]) & 0x7fff_ffff;
                        let (kind, flags) = (b[3], b[4]);
                        self.buf.clear();
                        if !wanted(kind) || kind == DATA {
                            if len == 0 {
                                out.push(Parsed::Skipped);
                            } else {
                                self.skip = len;
                            }
                        } else if len > MAX_BLOCK {
                            return Err(());
                        } else if len == 0 {
                            out.push(Parsed::Frame(kind, flags, stream, Vec::new()));
                        } else {
                            self.header = Some((len, kind, flags, stream));
                        }
                    }
                }
                Some((len, kind, flags, stream)) => {
                    let n = (len - self.buf.len()).min(bytes.len());
                    self.buf.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                    if self.buf.len() == len {
                        out.push(Parsed::Frame(
                            kind,
                            flags,
                            stream,
                            std::mem::take(&mut self.buf),
                        ));
                        self.header = None;
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Both directions of one connection.
struct Watch {
    socket: Arc<str>,
    observer: Arc<dyn TransportObserver>,
    /// Client preface bytes still expected.
    preface_seen: usize,
    inbound: Frames,
    outbound: Frames,
    decoder: loona_hpack::Decoder<'static>,
    /// The header block being assembled: (stream, bytes).
    block: Option<(u32, Vec<u8>)>,
    requests: VecDeque<(u32, WireRequest)>,
    /// Observation of what the peer sends stopped (an unparsable copy); the connection itself
    /// and the observation of what we send are unaffected.
    reading_stopped: bool,
    /// Observation of what we send stopped.
    writing_stopped: bool,
}

impl Watch {
    fn request(&self, stream: u32) -> Option<WireRequest> {
        self.requests
            .iter()
            .find(|(s, _)| *s == stream)
            .map(|(_, r)| r.clone())
    }

    fn read(&mut self, mut bytes: &[u8]) {
        if self.reading_stopped {
            return;
        }
        if self.preface_seen < PREFACE.len() {
            let n = (PREFACE.len() - self.preface_seen).min(bytes.len());
            if bytes[..n] != PREFACE[self.preface_seen..self.preface_seen + n] {
                let start = String::from_utf8_lossy(&bytes[..bytes.len().min(PREFACE.len())])
                    .escape_debug()
                    .to_string();
                self.observer
                    .observe(&self.socket, TransportEvent::NotHttp2 { start });
                self.reading_stopped = true;
                return;
            }
            self.preface_seen += n;
            bytes = &bytes[n..];
        }
        let wanted = |k| matches!(k, HEADERS | CONTINUATION | RST_STREAM | GOAWAY);
        let Ok(frames) = self.inbound.feed(bytes, wanted) else {
            self.reading_stopped = true;
            return;
        };
        for frame in frames {
            let Parsed::Frame(kind, flags, stream, payload) = frame else {
                continue;
            };
            match kind {
                HEADERS => {
                    let Some(fragment) = headers_fragment(flags, &payload) else {
                        self.reading_stopped = true;
                        return;
                    };
                    self.block = Some((stream, fragment.to_vec()));
                    if flags & END_HEADERS != 0 {
                        self.decode_block();
                    }
                }
                CONTINUATION => {
                    match &mut self.block {
                        Some((s, block))
                            if *s == stream && block.len() + payload.len() <= MAX_BLOCK =>
                        {
                            block.extend_from_slice(&payload);
                        }
                        _ => {
                            self.reading_stopped = true;
                            return;
                        }
                    }
                    if flags & END_HEADERS != 0 {
                        self.decode_block();
                    }
                }
                RST_STREAM => {
                    let code = code_at(&payload, 0);
                    if !matches!(code, Some(0x0 | 0x8)) {
                        let reason = code.map_or_else(|| "malformed".into(), reason_name);
                        let request = self.request(stream);
                        self.observer.observe(
                            &self.socket,
                            TransportEvent::ResetByPeer {
                                stream,
                                reason,
                                request,
                            },
                        );
                    }
                }
                GOAWAY => self.goaway(false, &payload),
                _ => {}
            }
        }
    }

    fn decode_block(&mut self) {
        let Some((stream, block)) = self.block.take() else {
            return;
        };
        let mut request = WireRequest::default();
        let decoded = self.decoder.decode_with_cb(&block, |name, value| {
            let value = String::from_utf8_lossy(&value).into_owned();
            match &*name {
                b":method" => request.method = value,
                b":path" => request.path = value,
                b":authority" => request.authority = value,
                b"user-agent" => request.user_agent = value,
                _ => {}
            }
        });
        if decoded.is_err() {
            // Our copy of the dynamic table can no longer follow the peer's.
            self.reading_stopped = true;
            return;
        }
        // Trailers carry no :path; keep the request the stream opened with.
        if request.path.is_empty() && request.method.is_empty() {
            return;
        }
        if self.requests.len() == REMEMBERED_STREAMS {
            self.requests.pop_front();
        }
        self.requests.push_back((stream, request));
    }

    fn goaway(&self, by_us: bool, payload: &[u8]) {
        let code = code_at(payload, 4);
        if matches!(code, Some(0x0)) {
            return;
        }
        let debug = payload
            .get(8..)
            .map(|d| String::from_utf8_lossy(d).into_owned())
            .unwrap_or_default();
        self.observer.observe(
            &self.socket,
            TransportEvent::GoAway {
                by_us,
                reason: code.map_or_else(|| "malformed".into(), reason_name),
                debug,
            },
        );
    }

    fn written(&mut self, bytes: &[u8]) {
        if self.writing_stopped {
            return;
        }
        let Ok(frames) = self
            .outbound
            .feed(bytes, |k| matches!(k, RST_STREAM | GOAWAY))
        else {
            self.writing_stopped = true;
            return;
        };
        for frame in frames {
            let Parsed::Frame(kind, _, stream, payload) = frame else {
                continue;
            };
            match kind {
                RST_STREAM => {
                    let reason =
                        code_at(&payload, 0).map_or_else(|| "malformed".into(), reason_name);
                    let request = self.request(stream);
                    self.observer.observe(
                        &self.socket,
                        TransportEvent::ResetByUs {
                            stream,
                            reason,
                            request,
                        },
                    );
                }
                GOAWAY => self.goaway(true, &payload),
                _ => {}
            }
        }
    }
}

/// The 32-bit error code at `offset` of a frame payload.
fn code_at(payload: &[u8], offset: usize) -> Option<u32> {
    let b = payload.get(offset..offset + 4)?;
    Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// The header block fragment of a HEADERS payload, without padding and priority fields.
fn headers_fragment(flags: u8, payload: &[u8]) -> Option<&[u8]> {
    let mut start = 0;
    let mut end = payload.len();
    if flags & PADDED != 0 {
        let pad = usize::from(*payload.first()?);
        start += 1;
        end = end.checked_sub(pad)?;
    }
    if flags & PRIORITY != 0 {
        start += 5;
    }
    payload.get(start..end)
}

/// A connection whose bytes pass through untouched while a copy is parsed for
/// [`TransportEvent`]s.
pub struct Tapped<T> {
    inner: T,
    watch: Watch,
}

impl<T> Tapped<T> {
    /// Wraps `inner`, an accepted connection on `socket`, reporting to `observer`.
    pub fn new(inner: T, socket: Arc<str>, observer: Arc<dyn TransportObserver>) -> Self {
        Self {
            inner,
            watch: Watch {
                socket,
                observer,
                preface_seen: 0,
                inbound: Frames::default(),
                outbound: Frames::default(),
                decoder: loona_hpack::Decoder::new(),
                block: None,
                requests: VecDeque::new(),
                reading_stopped: false,
                writing_stopped: false,
            },
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Tapped<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            this.watch.read(&buf.filled()[before..]);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tapped<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            this.watch.written(&buf[..n]);
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(mut n)) = r {
            for b in bufs {
                if n == 0 {
                    break;
                }
                let k = n.min(b.len());
                this.watch.written(&b[..k]);
                n -= k;
            }
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<T: Connected> Connected for Tapped<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Recorded(Mutex<Vec<TransportEvent>>);

    impl TransportObserver for Recorded {
        fn observe(&self, socket: &str, event: TransportEvent) {
            assert_eq!(socket, "/run/test.sock");
            self.0.lock().unwrap().push(event);
        }
    }

    fn watch() -> (Watch, Arc<Recorded>) {
        let recorded = Arc::new(Recorded::default());
        let observer: Arc<dyn TransportObserver> = recorded.clone();
        let tapped = Tapped::new((), Arc::from("/run/test.sock"), observer);
        (tapped.watch, recorded)
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn block(encoder: &mut loona_hpack::Encoder<'_>, headers: &[(&str, &str)]) -> Vec<u8> {
        encoder.encode(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
    }

    const GET_INFO: [(&str, &str); 5] = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/pluginregistration.Registration/GetInfo"),
        (
            ":authority",
            "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fx-reg.sock",
        ),
        ("user-agent", "grpc-go/1.79.3"),
    ];

    fn get_info() -> WireRequest {
        WireRequest {
            method: "POST".into(),
            path: "/pluginregistration.Registration/GetInfo".into(),
            authority: "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fx-reg.sock".into(),
            user_agent: "grpc-go/1.79.3".into(),
        }
    }

    #[test]
    fn a_reset_we_send_is_reported_with_the_request_that_caused_it() {
        let (mut w, recorded) = watch();
        let mut enc = loona_hpack::Encoder::new();
        let mut inbound = PREFACE.to_vec();
        inbound.extend(frame(0x4, 0, 0, &[]));
        inbound.extend(frame(HEADERS, END_HEADERS, 1, &block(&mut enc, &GET_INFO)));
        inbound.extend(frame(DATA, 0x1, 1, &[0, 0, 0, 0, 0]));
        // Byte by byte, as the socket may deliver it.
        for b in &inbound {
            w.read(std::slice::from_ref(b));
        }
        w.written(&frame(RST_STREAM, 0, 1, &1u32.to_be_bytes()));
        assert_eq!(
            *recorded.0.lock().unwrap(),
            [TransportEvent::ResetByUs {
                stream: 1,
                reason: "PROTOCOL_ERROR".into(),
                request: Some(get_info()),
            }]
        );
    }

    #[test]
    fn requests_that_reuse_the_dynamic_table_and_continuation_frames_are_decoded() {
        let (mut w, recorded) = watch();
        let mut enc = loona_hpack::Encoder::new();
        let mut inbound = PREFACE.to_vec();
        inbound.extend(frame(HEADERS, END_HEADERS, 1, &block(&mut enc, &GET_INFO)));
        // The second request's block refers to the first one's entries; split it in two frames,
        // the first one padded and with a priority.
        let second = block(&mut enc, &GET_INFO);
        let (a, b) = second.split_at(second.len() / 2);
        let mut padded = vec![3u8];
        padded.extend_from_slice(&[0, 0, 0, 0, 16]);
        padded.extend_from_slice(a);
        padded.extend_from_slice(&[0, 0, 0]);
        inbound.extend(frame(HEADERS, PADDED | PRIORITY, 3, &padded));
        inbound.extend(frame(CONTINUATION, END_HEADERS, 3, b));
        w.read(&inbound);
        w.written(&frame(RST_STREAM, 0, 3, &7u32.to_be_bytes()));
        assert_eq!(
            *recorded.0.lock().unwrap(),
            [TransportEvent::ResetByUs {
                stream: 3,
                reason: "REFUSED_STREAM".into(),
                request: Some(get_info()),
            }]
        );
    }

    #[test]
    fn a_peers_cancel_is_quiet_and_its_errors_and_goaways_are_reported() {
        let (mut w, recorded) = watch();
        let mut inbound = PREFACE.to_vec();
        inbound.extend(frame(RST_STREAM, 0, 1, &8u32.to_be_bytes()));
        inbound.extend(frame(RST_STREAM, 0, 3, &2u32.to_be_bytes()));
        let mut goaway = 3u32.to_be_bytes().to_vec();
        goaway.extend_from_slice(&0u32.to_be_bytes());
        inbound.extend(frame(GOAWAY, 0, 0, &goaway));
        w.read(&inbound);
        let mut ours = 0u32.to_be_bytes().to_vec();
        ours.extend_from_slice(&1u32.to_be_bytes());
        ours.extend_from_slice(b"bad frame");
        w.written(&frame(GOAWAY, 0, 0, &ours));
        assert_eq!(
            *recorded.0.lock().unwrap(),
            [
                TransportEvent::ResetByPeer {
                    stream: 3,
                    reason: "INTERNAL_ERROR".into(),
                    request: None,
                },
                TransportEvent::GoAway {
                    by_us: true,
                    reason: "PROTOCOL_ERROR".into(),
                    debug: "bad frame".into(),
                },
            ]
        );
    }

    #[test]
    fn a_peer_that_does_not_speak_http2_is_reported_once() {
        let (mut w, recorded) = watch();
        w.read(b"GET / HTTP/1.1\r\n");
        w.read(b"Host: x\r\n\r\n");
        assert_eq!(
            *recorded.0.lock().unwrap(),
            [TransportEvent::NotHttp2 {
                start: "GET / HTTP/1.1\\r\\n".into()
            }]
        );
    }

    #[test]
    fn arbitrary_bytes_in_either_direction_never_panic() {
        // A small deterministic generator (xorshift): frames with random types, flags, lengths
        // and payloads, after a valid preface and without one, cut at random points.
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..2_000 {
            let (mut w, _) = watch();
            let mut bytes = if round % 4 == 0 {
                Vec::new()
            } else {
                PREFACE.to_vec()
            };
            for _ in 0..(next() % 8) {
                let kind = (next() % 11) as u8;
                let flags = next() as u8;
                let len = (next() % 64) as usize;
                let payload: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                bytes.extend(frame(kind, flags, (next() % 4) as u32, &payload));
            }
            let mut rest = &bytes[..];
            while !rest.is_empty() {
                let n = 1 + (next() as usize % rest.len());
                w.read(&rest[..n]);
                w.written(&rest[..n]);
                rest = &rest[n..];
            }
        }
    }

    #[test]
    fn an_oversized_header_block_ends_observation_of_the_peer_only() {
        let (mut w, recorded) = watch();
        let mut inbound = PREFACE.to_vec();
        let len = MAX_BLOCK + 1;
        inbound.extend([(len >> 16) as u8, (len >> 8) as u8, len as u8, HEADERS, 0]);
        inbound.extend(1u32.to_be_bytes());
        w.read(&inbound);
        assert!(w.reading_stopped);
        w.written(&frame(RST_STREAM, 0, 1, &1u32.to_be_bytes()));
        assert_eq!(
            *recorded.0.lock().unwrap(),
            [TransportEvent::ResetByUs {
                stream: 1,
                reason: "PROTOCOL_ERROR".into(),
                request: None,
            }]
        );
    }
}
