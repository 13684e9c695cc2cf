//! Where the device's reserved memory lies, page by page (`pool/layout.rs`): each segment's
//! blocks in address order, and the spare pages.

use super::*;
use crate::pool::layout::{Layout, Piece};

impl DevicePool {
    /// Where the reserved memory lies (see [`Layout`]): exact where no driver call is in
    /// flight and no range is kept for a retry.
    pub fn layout(&self) -> Layout {
        let mut layout = Layout::default();
        for (_, seg) in self.segments.enumerate().filter(|(_, s)| s.in_use) {
            let mut id = seg.first;
            // A fragment's lead, its lender's bytes, first: the segment starts on a page.
            let lead = (seg.lead > 0).then_some(Piece::Elsewhere(seg.lead));
            let pieces = lead.into_iter().chain(std::iter::from_fn(|| {
                if id == BlockId::NIL {
                    return None;
                }
                let b = &self.blocks[id];
                id = b.next;
                Some(match b.state {
                    State::Live => Piece::Live {
                        size: b.size,
                        requested: b.requested,
                    },
                    State::Hole => Piece::Elsewhere(b.size),
                    State::Free | State::Parked | State::Pending | State::Vacant => {
                        Piece::Free(b.size)
                    }
                })
            }));
            layout.add_segment(pieces);
        }
        layout.add_idle(self.phys.spare_bytes());
        layout
    }
}
