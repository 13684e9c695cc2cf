//! A reader of Python pickles as `torch.cuda.memory._dump_snapshot` writes them (protocols 2
//! to 5 of Python's pickler, and the older text opcodes): dicts, lists, tuples, sets, strings,
//! bytes, numbers, booleans and `None`. Any other object (a class instance, a global) reads as
//! `None`: a snapshot holds none that the replay needs.
//!
//! Python's pickler writes an object once and refers to it again by its memo index wherever it
//! is shared: a snapshot's call-stack frames are shared by every event with that stack, and the
//! strings in them by every frame. The objects are built once, in an arena whose containers
//! hold indices, and read in place through [`Obj`]: a shared object is whole at each of its
//! places (a general value reader that counts memo references instead loses shared strings
//! inside shared dicts), and nothing is copied, so a small hostile pickle that shares an object
//! many times over cannot expand into an unbounded tree, nor one that contains itself loop.

use std::collections::HashMap;

/// A value that is not a container.
#[derive(Clone, Debug, PartialEq)]
pub enum Scalar {
    /// `None`, and any object that is not one of the kinds here.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// An integer (one that does not fit in 128 bits reads as `None`).
    Int(i128),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// Bytes.
    Bytes(Vec<u8>),
}

/// A pickle read into memory.
pub struct Pickle {
    nodes: Vec<Node>,
    top: usize,
}

impl Pickle {
    /// The pickled object.
    pub fn root(&self) -> Obj<'_> {
        Obj {
            pickle: self,
            index: self.top,
        }
    }
}

/// One object of a [`Pickle`], read in place.
#[derive(Clone, Copy)]
pub struct Obj<'a> {
    pickle: &'a Pickle,
    index: usize,
}

impl<'a> Obj<'a> {
    fn at(self, index: usize) -> Obj<'a> {
        Obj {
            pickle: self.pickle,
            index,
        }
    }

    fn node(self) -> &'a Node {
        &self.pickle.nodes[self.index]
    }

    /// Whether this is a dict.
    pub fn is_dict(self) -> bool {
        matches!(self.node(), Node::Dict(_))
    }

    /// The value of string key `key`, where this is a dict that has it.
    pub fn get(self, key: &str) -> Option<Obj<'a>> {
        self.items()?
            .find(|(k, _)| k.text() == Some(key))
            .map(|(_, v)| v)
    }

    /// The items in the order written, where this is a dict.
    pub fn items(self) -> Option<impl Iterator<Item = (Obj<'a>, Obj<'a>)>> {
        match self.node() {
            Node::Dict(pairs) => Some(pairs.iter().map(move |&(k, v)| (self.at(k), self.at(v)))),
            _ => None,
        }
    }

    /// The elements in order, where this is a list, tuple or set.
    pub fn list(self) -> Option<Vec<Obj<'a>>> {
        match self.node() {
            Node::List(items) => Some(items.iter().map(|&i| self.at(i)).collect()),
            _ => None,
        }
    }

    /// The scalar, where this is not a container.
    pub fn scalar(self) -> Option<&'a Scalar> {
        match self.node() {
            Node::Scalar(s) => Some(s),
            Node::Opaque => Some(&Scalar::None),
            _ => None,
        }
    }

    /// The integer, where this is one.
    pub fn int(self) -> Option<i128> {
        match self.scalar()? {
            Scalar::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The string, where this is one.
    pub fn text(self) -> Option<&'a str> {
        match self.scalar()? {
            Scalar::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// An object as it is being built: containers hold arena indices, so that sharing stays.
enum Node {
    Scalar(Scalar),
    List(Vec<usize>),
    Dict(Vec<(usize, usize)>),
    /// A class instance or global: read as `None`.
    Opaque,
}

/// Something on the unpickler's stack: an object, or a mark.
#[derive(Clone, Copy)]
enum Slot {
    Node(usize),
    Mark,
}

/// Read one pickle from `bytes`.
pub fn read(bytes: &[u8]) -> Result<Pickle, String> {
    let mut r = Reader {
        bytes,
        pos: 0,
        nodes: Vec::new(),
        stack: Vec::new(),
        memo: HashMap::new(),
    };
    let top = r.run()?;
    Ok(Pickle {
        nodes: r.nodes,
        top,
    })
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    nodes: Vec<Node>,
    stack: Vec<Slot>,
    memo: HashMap<u64, usize>,
}

impl Reader<'_> {
    fn run(&mut self) -> Result<usize, String> {
        loop {
            let at = self.pos;
            let op = self.take(1)?[0];
            match op {
                0x80 => {
                    self.take(1)?; // PROTO
                }
                0x95 => {
                    self.take(8)?; // FRAME: a length hint
                }
                b'.' => return self.pop_node(), // STOP
                b'(' => self.stack.push(Slot::Mark),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let top = *self.stack.last().ok_or("DUP on an empty stack")?;
                    self.stack.push(top);
                }
                b'N' => self.push(Node::Scalar(Scalar::None)),
                0x88 => self.push(Node::Scalar(Scalar::Bool(true))),
                0x89 => self.push(Node::Scalar(Scalar::Bool(false))),
                b'J' => {
                    let v = i32::from_le_bytes(self.array()?);
                    self.push_int(i128::from(v));
                }
                b'K' => {
                    let v = self.take(1)?[0];
                    self.push_int(i128::from(v));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.array()?);
                    self.push_int(i128::from(v));
                }
                0x8a => {
                    let n = usize::from(self.take(1)?[0]);
                    let v = self.long(n)?;
                    self.push(Node::Scalar(v));
                }
                0x8b => {
                    let n = self.len4()?;
                    let v = self.long(n)?;
                    self.push(Node::Scalar(v));
                }
                b'I' | b'L' => {
                    let line = self.line()?;
                    let text = line.trim_end_matches('L');
                    let v = match text {
                        "00" => Scalar::Bool(false),
                        "01" => Scalar::Bool(true),
                        _ => text.parse().map(Scalar::Int).unwrap_or(Scalar::None),
                    };
                    self.push(Node::Scalar(v));
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.array()?);
                    self.push(Node::Scalar(Scalar::Float(v)));
                }
                b'F' => {
                    let line = self.line()?;
                    let v = line
                        .parse()
                        .map_err(|_| format!("a float that does not parse at byte {at}"))?;
                    self.push(Node::Scalar(Scalar::Float(v)));
                }
                b'X' => {
                    let n = self.len4()?;
                    self.push_str(n)?;
                }
                0x8c => {
                    let n = usize::from(self.take(1)?[0]);
                    self.push_str(n)?;
                }
                0x8d => {
                    let n = self.len8()?;
                    self.push_str(n)?;
                }
                b'V' => {
                    let line = self.line()?;
                    self.push(Node::Scalar(Scalar::Str(line)));
                }
                b'B' | b'T' => {
                    let n = self.len4()?;
                    self.push_bytes(n)?;
                }
                b'C' | b'U' => {
                    let n = usize::from(self.take(1)?[0]);
                    self.push_bytes(n)?;
                }
                0x8e | 0x96 => {
                    let n = self.len8()?;
                    self.push_bytes(n)?;
                }
                b'S' => {
                    let line = self.line()?;
                    self.push(Node::Scalar(Scalar::Str(line)));
                }
                b'}' => self.push(Node::Dict(Vec::new())),
                b']' | 0x8f => self.push(Node::List(Vec::new())),
                b')' => self.push(Node::List(Vec::new())),
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(&items)?;
                    self.push(Node::Dict(pairs));
                }
                b'l' | b't' | 0x91 => {
                    let items = self.pop_mark()?;
                    self.push(Node::List(items));
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop_node()?);
                    }
                    items.reverse();
                    self.push(Node::List(items));
                }
                b'a' => {
                    let item = self.pop_node()?;
                    self.extend_list(vec![item])?;
                }
                b'e' | 0x90 => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                b's' => {
                    let value = self.pop_node()?;
                    let key = self.pop_node()?;
                    self.extend_dict(vec![(key, value)])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(&items)?;
                    self.extend_dict(pairs)?;
                }
                0x94 => {
                    let top = self.top_node()?;
                    let id = self.memo.len() as u64;
                    self.memo.insert(id, top);
                }
                // BINPUT, LONG_BINPUT, PUT; BINGET, LONG_BINGET, GET.
                b'q' | b'r' | b'p' => {
                    let id = self.memo_index(op)?;
                    self.put(id)?;
                }
                b'h' | b'j' | b'g' => {
                    let id = self.memo_index(op)?;
                    self.get(id)?;
                }
                b'c' => {
                    self.line()?;
                    self.line()?;
                    self.push(Node::Opaque);
                }
                0x93 => {
                    self.pop()?;
                    self.pop()?;
                    self.push(Node::Opaque);
                }
                // REDUCE, NEWOBJ: callable and arguments make an object.
                b'R' | 0x81 => {
                    self.pop()?;
                    self.pop()?;
                    self.push(Node::Opaque);
                }
                0x92 => {
                    self.pop()?;
                    self.pop()?;
                    self.pop()?;
                    self.push(Node::Opaque);
                }
                // BUILD: the object takes its state; it stays opaque.
                b'b' => {
                    self.pop()?;
                }
                b'o' => {
                    self.pop_mark()?;
                    self.push(Node::Opaque);
                }
                b'i' => {
                    self.line()?;
                    self.line()?;
                    self.pop_mark()?;
                    self.push(Node::Opaque);
                }
                _ => {
                    return Err(format!(
                        "opcode 0x{op:02x} at byte {at} is not one a memory snapshot uses"
                    ))
                }
            }
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| format!("the pickle ends early (byte {})", self.pos))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn len4(&mut self) -> Result<usize, String> {
        Ok(u32::from_le_bytes(self.array()?) as usize)
    }

    fn len8(&mut self) -> Result<usize, String> {
        usize::try_from(u64::from_le_bytes(self.array()?)).map_err(|_| "a length too large".into())
    }

    /// A text operand: up to the next newline.
    fn line(&mut self) -> Result<String, String> {
        let rest = &self.bytes[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("a text operand without its newline")?;
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.pos += n + 1;
        Ok(s)
    }

    /// The memo index operand of `op`: one byte, four, or a line of text.
    fn memo_index(&mut self, op: u8) -> Result<u64, String> {
        match op {
            b'q' | b'h' => Ok(u64::from(self.take(1)?[0])),
            b'r' | b'j' => Ok(u64::from(u32::from_le_bytes(self.array()?))),
            _ => {
                let at = self.pos;
                let line = self.line()?;
                line.parse()
                    .map_err(|_| format!("a memo index that is not a number at byte {at}"))
            }
        }
    }

    /// A little-endian two's-complement integer of `n` bytes.
    fn long(&mut self, n: usize) -> Result<Scalar, String> {
        let b = self.take(n)?;
        if n > 16 {
            return Ok(Scalar::None);
        }
        let mut v: i128 = 0;
        for (i, &byte) in b.iter().enumerate() {
            v |= i128::from(byte) << (8 * i);
        }
        if n > 0 && n < 16 && b[n - 1] & 0x80 != 0 {
            v -= 1i128 << (8 * n);
        }
        Ok(Scalar::Int(v))
    }

    fn push(&mut self, node: Node) {
        self.nodes.push(node);
        self.stack.push(Slot::Node(self.nodes.len() - 1));
    }

    fn push_int(&mut self, v: i128) {
        self.push(Node::Scalar(Scalar::Int(v)));
    }

    fn push_str(&mut self, n: usize) -> Result<(), String> {
        let s = String::from_utf8_lossy(self.take(n)?).into_owned();
        self.push(Node::Scalar(Scalar::Str(s)));
        Ok(())
    }

    fn push_bytes(&mut self, n: usize) -> Result<(), String> {
        let b = self.take(n)?.to_vec();
        self.push(Node::Scalar(Scalar::Bytes(b)));
        Ok(())
    }

    fn pop(&mut self) -> Result<Slot, String> {
        self.stack
            .pop()
            .ok_or_else(|| format!("the stack is empty at byte {}", self.pos))
    }

    fn pop_node(&mut self) -> Result<usize, String> {
        match self.pop()? {
            Slot::Node(i) => Ok(i),
            Slot::Mark => Err(format!(
                "a mark where an object was due (byte {})",
                self.pos
            )),
        }
    }

    fn top_node(&self) -> Result<usize, String> {
        match self.stack.last() {
            Some(Slot::Node(i)) => Ok(*i),
            _ => Err(format!("no object to remember at byte {}", self.pos)),
        }
    }

    /// The objects above the topmost mark, in order; the mark is removed.
    fn pop_mark(&mut self) -> Result<Vec<usize>, String> {
        let mut items = Vec::new();
        loop {
            match self.pop()? {
                Slot::Mark => break,
                Slot::Node(i) => items.push(i),
            }
        }
        items.reverse();
        Ok(items)
    }

    fn put(&mut self, id: u64) -> Result<(), String> {
        let top = self.top_node()?;
        self.memo.insert(id, top);
        Ok(())
    }

    fn get(&mut self, id: u64) -> Result<(), String> {
        let node = *self
            .memo
            .get(&id)
            .ok_or_else(|| format!("memo index {id} was never set (byte {})", self.pos))?;
        self.stack.push(Slot::Node(node));
        Ok(())
    }

    fn extend_list(&mut self, items: Vec<usize>) -> Result<(), String> {
        let top = self.top_node()?;
        match &mut self.nodes[top] {
            Node::List(list) => list.extend(items),
            Node::Opaque => {}
            _ => return Err(format!("appending to a non-list at byte {}", self.pos)),
        }
        Ok(())
    }

    fn extend_dict(&mut self, pairs: Vec<(usize, usize)>) -> Result<(), String> {
        let top = self.top_node()?;
        match &mut self.nodes[top] {
            Node::Dict(dict) => dict.extend(pairs),
            Node::Opaque => {}
            _ => {
                return Err(format!(
                    "setting an item of a non-dict at byte {}",
                    self.pos
                ))
            }
        }
        Ok(())
    }
}

/// Alternating keys and values as pairs.
fn pairs(items: &[usize]) -> Result<Vec<(usize, usize)>, String> {
    if items.len() % 2 != 0 {
        return Err("a dict's items with a key and no value".into());
    }
    Ok(items.chunks(2).map(|kv| (kv[0], kv[1])).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A readable rendering, to compare with what Python wrote.
    fn show(o: Obj<'_>) -> String {
        if let Some(items) = o.items() {
            let items: Vec<String> = items
                .map(|(k, v)| format!("{}: {}", show(k), show(v)))
                .collect();
            return format!("{{{}}}", items.join(", "));
        }
        if let Some(list) = o.list() {
            let items: Vec<String> = list.into_iter().map(show).collect();
            return format!("[{}]", items.join(", "));
        }
        match o.scalar().unwrap() {
            Scalar::None => "None".into(),
            Scalar::Bool(b) => b.to_string(),
            Scalar::Int(i) => i.to_string(),
            Scalar::Float(f) => format!("{f:?}"),
            Scalar::Str(s) => format!("'{s}'"),
            Scalar::Bytes(b) => format!("b{b:?}"),
        }
    }

    fn read_shown(bytes: &[u8]) -> String {
        show(read(bytes).unwrap().root())
    }

    #[test]
    fn a_shared_dict_and_its_shared_strings_read_whole_at_each_place() {
        // pickle.dumps([d, d, 'x'], protocol=4) with d = {'a': 'x'}: d and 'x' are written
        // once and referred to by memo index (BINGET) after.
        let bytes = b"\x80\x04\x95\x14\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94\x8c\x01a\x94\x8c\
                      \x01x\x94sh\x01h\x03e.";
        assert_eq!(read_shown(bytes), "[{'a': 'x'}, {'a': 'x'}, 'x']");
        let p = read(bytes).unwrap();
        let list = p.root().list().unwrap();
        assert_eq!(list[1].get("a").and_then(Obj::text), Some("x"));
        assert!(list[0].is_dict() && !list[2].is_dict());
        // The same with protocol 2 (BINPUT, BINUNICODE).
        let bytes = b"\x80\x02]q\x00(}q\x01X\x01\x00\x00\x00aq\x02X\x01\x00\x00\x00xq\x03sh\
                      \x01h\x03e.";
        assert_eq!(read_shown(bytes), "[{'a': 'x'}, {'a': 'x'}, 'x']");
        // And with protocol 0's text opcodes (PUT, GET).
        let bytes = b"(lp0\n(dp1\nVa\np2\nVx\np3\nsag1\nag3\na.";
        assert_eq!(read_shown(bytes), "[{'a': 'x'}, {'a': 'x'}, 'x']");
    }

    #[test]
    fn numbers_booleans_and_none_read_as_python_wrote_them() {
        // pickle.dumps([0, 255, 65535, -1, 2**40, -(2**70), 1.5, True, False, None, b'\x01',
        // (1, 2)], protocol=4)
        let bytes = b"\x80\x04\x95:\x00\x00\x00\x00\x00\x00\x00]\x94(K\x00K\xffM\xff\xffJ\xff\
                      \xff\xff\xff\x8a\x06\x00\x00\x00\x00\x00\x01\x8a\t\x00\x00\x00\x00\x00\x00\
                      \x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00\x88\x89NC\x01\x01\x94K\x01K\x02\
                      \x86\x94e.";
        assert_eq!(
            read_shown(bytes),
            format!(
                "[0, 255, 65535, -1, {}, {}, 1.5, true, false, None, b[1], [1, 2]]",
                1u64 << 40,
                -(1i128 << 70)
            )
        );
    }

    #[test]
    fn a_list_that_holds_itself_is_read_without_looping() {
        // l = [1]; l.append(l); pickle.dumps(l, protocol=2)
        let p = read(b"\x80\x02]q\x00(K\x01h\x00e.").unwrap();
        let list = p.root().list().unwrap();
        assert_eq!(list[0].int(), Some(1));
        assert_eq!(list[1].list().unwrap()[0].int(), Some(1));
    }

    #[test]
    fn a_pickle_sharing_one_list_many_times_over_stays_its_own_size() {
        // x = []; for _ in range(64): x = [x, x] -- 2**64 lists if copied at each place.
        let mut bytes = b"\x80\x04]\x94".to_vec();
        for _ in 0..64 {
            // the list on top twice (DUP), as a pair (TUPLE2), remembered (MEMOIZE)
            bytes.extend_from_slice(b"2\x86\x94");
        }
        bytes.push(b'.');
        let p = read(&bytes).unwrap();
        let mut o = p.root();
        for _ in 0..64 {
            o = o.list().unwrap()[1];
        }
        assert_eq!(o.list().map(|l| l.len()), Some(0));
    }

    #[test]
    fn objects_read_as_none_and_bad_input_is_refused_with_where() {
        // pickle.dumps({'t': collections.OrderedDict()}, protocol=2)
        let bytes = b"\x80\x02}q\x00X\x01\x00\x00\x00tq\x01ccollections\nOrderedDict\nq\x02)Rq\
                      \x03s.";
        assert_eq!(read_shown(bytes), "{'t': None}");
        let err = |bytes: &[u8]| read(bytes).err().unwrap();
        assert_eq!(err(b"\x80\x04]\x94("), "the pickle ends early (byte 5)");
        assert_eq!(
            err(b"\x80\x04h\x07."),
            "memo index 7 was never set (byte 4)"
        );
        assert_eq!(
            err(b"\x80\x04\xff"),
            "opcode 0xff at byte 2 is not one a memory snapshot uses"
        );
        assert_eq!(err(b""), "the pickle ends early (byte 0)");
        assert_eq!(
            err(b"\x80\x04(."),
            "a mark where an object was due (byte 4)"
        );
    }
}
