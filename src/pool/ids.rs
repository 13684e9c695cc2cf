//! Typed indexes into a device pool's arenas: blocks ([`BlockId`]), segments ([`SegId`]),
//! stream slots ([`SlotId`]) and places in the idle list ([`IdleAt`]). Each is a `u32` of its own
//! type, so that one kind cannot be passed where another is meant, and prints with its kind
//! (`b17`, `s3`, `slot2`, `idle5`). [`Table`] is a vector indexed by one kind.

use std::fmt;
use std::marker::PhantomData;

/// An index of one kind into a [`Table`].
pub trait Id: Copy {
    /// The id of position `index`.
    fn at(index: usize) -> Self;
    /// Its position in its table.
    fn index(self) -> usize;
}

macro_rules! id {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(u32);

        impl Id for $name {
            #[inline]
            fn at(index: usize) -> Self {
                $name(u32::try_from(index).expect(concat!("more than 4 billion ", $what)))
            }

            #[inline]
            fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                if self.0 == u32::MAX {
                    write!(f, concat!($kind, "-nil"))
                } else {
                    write!(f, concat!($kind, "{}"), self.0)
                }
            }
        }
    };
}

id!(
    /// A block in the arena of `blocks.rs`; [`BlockId::NIL`] ends a segment's chain.
    BlockId,
    "b",
    "blocks"
);
id!(
    /// A segment of a device pool.
    SegId,
    "s",
    "segments"
);
id!(
    /// A stream's slot (its bins and parked blocks) in a device pool.
    SlotId,
    "slot",
    "stream slots"
);
id!(
    /// A place in a device pool's list of idle segments.
    IdleAt,
    "idle",
    "idle segments"
);

impl BlockId {
    /// No block: the end of a segment's chain of address neighbours.
    pub const NIL: BlockId = BlockId(u32::MAX);
}

impl SlotId {
    /// No slot: the slot of a vacant segment.
    pub const NIL: SlotId = SlotId(u32::MAX);
}

/// A vector whose positions are ids of kind `I`.
pub struct Table<I, T> {
    items: Vec<T>,
    kind: PhantomData<fn(I) -> I>,
}

impl<I, T> Default for Table<I, T> {
    fn default() -> Self {
        Table {
            items: Vec::new(),
            kind: PhantomData,
        }
    }
}

impl<I: Id, T> Table<I, T> {
    /// Add `item` at the end; returns its id.
    pub fn push(&mut self, item: T) -> I {
        let id = I::at(self.items.len());
        self.items.push(item);
        id
    }

    /// The item at `id`, if there is one.
    pub fn get(&self, id: I) -> Option<&T> {
        self.items.get(id.index())
    }

    /// The last item.
    pub fn last(&self) -> Option<&T> {
        self.items.last()
    }

    /// Remove the item at `id`, moving the last one into its place.
    pub fn swap_remove(&mut self, id: I) -> T {
        self.items.swap_remove(id.index())
    }

    /// Number of items.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Room held, in items.
    pub fn capacity(&self) -> usize {
        self.items.capacity()
    }

    /// The items in order.
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.items.iter()
    }

    /// The items in order, with their ids.
    pub fn enumerate(&self) -> impl Iterator<Item = (I, &T)> + '_ {
        self.items
            .iter()
            .enumerate()
            .map(|(at, item)| (I::at(at), item))
    }

    /// Every id, in order (borrowing nothing: the table may change meanwhile).
    pub fn ids(&self) -> std::iter::Map<std::ops::Range<usize>, fn(usize) -> I> {
        (0..self.items.len()).map(I::at)
    }
}

impl<I: Id, T> std::ops::Index<I> for Table<I, T> {
    type Output = T;
    #[inline]
    fn index(&self, id: I) -> &T {
        &self.items[id.index()]
    }
}

impl<I: Id, T> std::ops::IndexMut<I> for Table<I, T> {
    #[inline]
    fn index_mut(&mut self, id: I) -> &mut T {
        &mut self.items[id.index()]
    }
}

impl<'a, I, T> IntoIterator for &'a Table<I, T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_their_kind_and_index_their_table() {
        assert_eq!(format!("{:?}", BlockId::at(17)), "b17");
        assert_eq!(format!("{:?}", SegId::at(3)), "s3");
        assert_eq!(format!("{:?}", SlotId::at(2)), "slot2");
        assert_eq!(format!("{:?}", IdleAt::at(5)), "idle5");
        assert_eq!(format!("{:?}", BlockId::NIL), "b-nil");
        let mut table: Table<SegId, &str> = Table::default();
        let a = table.push("a");
        let b = table.push("b");
        assert_eq!((a, b, table.len()), (SegId::at(0), SegId::at(1), 2));
        assert_eq!((table[b], table.get(SegId::at(2))), ("b", None));
        table[a] = "c";
        assert_eq!(
            table.enumerate().collect::<Vec<_>>(),
            [(a, &"c"), (b, &"b")]
        );
        assert_eq!(table.swap_remove(a), "c");
        assert_eq!((table[a], table.len()), ("b", 1));
    }
}
