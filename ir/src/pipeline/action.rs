//! The vocabulary of a pipeline schedule: one [`Action`] per step a rank takes (a chunk's
//! forward `F`, backward `BW` or its zero-bubble halves `B` and `W`, or a `Send`/`Recv` of
//! an activation or gradient), as construction, simulation and validation share it.

use std::fmt;

/// What a pipeline action does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActionKind {
    /// Forward of one chunk for one microbatch.
    F,
    /// Input-gradient backward (zero-bubble split); needs a later `W`.
    B,
    /// Weight-gradient backward (zero-bubble split); follows the `B` of the same pair.
    W,
    /// Full backward: `B` and `W` fused.
    BW,
    /// Send a tensor to rank `peer` (non-blocking: the data arrives after `Costs::send`).
    Send {
        /// Activation (forward) or gradient (backward).
        payload: Payload,
        /// Destination rank.
        peer: u32,
    },
    /// Receive a tensor from rank `peer` (blocks until the matching `Send` has arrived).
    Recv {
        /// Activation (forward) or gradient (backward).
        payload: Payload,
        /// Source rank.
        peer: u32,
    },
}

/// The tensor a `Send`/`Recv` moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Payload {
    /// Output activation of chunk `c`, moving to the rank of chunk `c + 1`.
    Activation,
    /// Input gradient computed by chunk `c`, moving to the rank of chunk `c - 1`.
    Gradient,
}

/// One step of a rank's action list.
///
/// For `Send`/`Recv`, `chunk` is the chunk that *produced* the tensor: the activation of
/// `(c, j)` feeds `F` of `(c + 1, j)`; the gradient of `(c, j)` feeds the backward of
/// `(c - 1, j)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Action {
    /// What the action does.
    pub kind: ActionKind,
    /// Global chunk (virtual stage) index, `0..pp * vpp`.
    pub chunk: u32,
    /// Microbatch index, `0..m`.
    pub microbatch: u32,
}

impl Action {
    /// A compute action (`F`, `B`, `W` or `BW`).
    pub fn compute(kind: ActionKind, chunk: u32, microbatch: u32) -> Action {
        Action {
            kind,
            chunk,
            microbatch,
        }
    }

    /// True for `F`, `B`, `W` and `BW`.
    pub fn is_compute(&self) -> bool {
        matches!(
            self.kind,
            ActionKind::F | ActionKind::B | ActionKind::W | ActionKind::BW
        )
    }

    /// The rendering token: `F3`, or `F1.3` (chunk 1, microbatch 3) when `show_chunk`;
    /// communication as `sA1.3>2` (send activation to rank 2), `rG2.3<2` (receive gradient
    /// from rank 2).
    pub fn token(&self, show_chunk: bool) -> String {
        let label = if show_chunk {
            format!("{}.{}", self.chunk, self.microbatch)
        } else {
            format!("{}", self.microbatch)
        };
        let p = |payload: Payload| match payload {
            Payload::Activation => 'A',
            Payload::Gradient => 'G',
        };
        match self.kind {
            ActionKind::F => format!("F{label}"),
            ActionKind::B => format!("B{label}"),
            ActionKind::W => format!("W{label}"),
            ActionKind::BW => format!("BW{label}"),
            ActionKind::Send { payload, peer } => format!("s{}{label}>{peer}", p(payload)),
            ActionKind::Recv { payload, peer } => format!("r{}{label}<{peer}", p(payload)),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.token(true))
    }
}

/// Same message: kind, chunk, microbatch (the peer is checked by the channel).
pub(crate) fn same_message(send: &Action, recv: &Action) -> bool {
    let payload = |a: &Action| match a.kind {
        ActionKind::Send { payload, .. } | ActionKind::Recv { payload, .. } => Some(payload),
        _ => None,
    };
    payload(send) == payload(recv) && send.chunk == recv.chunk && send.microbatch == recv.microbatch
}
