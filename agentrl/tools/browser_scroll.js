// Scroll the element under the viewport's centre (or the page) by dy pixels.
// Evaluated by agentrl/tools/browser.py as a function of dy.
(dy) => {
  let el = document.elementFromPoint(innerWidth / 2, innerHeight / 2);
  while (el && el !== document.body && el !== document.documentElement) {
    const s = getComputedStyle(el);
    if (/(auto|scroll)/.test(s.overflowY) && el.scrollHeight > el.clientHeight) break;
    el = el.parentElement;
  }
  if (!el || el === document.body || el === document.documentElement) {
    el = document.scrollingElement;
  }
  el.scrollBy({top: dy, behavior: 'instant'});
}
